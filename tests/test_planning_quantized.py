"""QLoRA's 4-bit base in the plan (planning/quantized.py): zero2, zero3 and zero3-offload hold their
rows of the base in torchao's NF4 and gather it in 4 bits, so a base that a 16-bit one would not let
fit does, its share falls with the ranks, and zero3-offload keeps it in host RAM; device_map's devices
and pipeline's ranks hold their blocks' layers whole in NF4; single's and ddp's figures stay
bitsandbytes' (pinned as they were before FSDP2 ran a 4-bit base); the NF4 dequantisation's bytes
(adapters/nf4.py's) are read off its operators here."""
from __future__ import annotations

import sys

import pytest
from transformers import LlamaConfig

from bigfit.adapters.lora import LoraSettings
from bigfit.machine.hardware import Hardware
from bigfit.planning import quantized
from bigfit.planning.workload import Workload

GB = 10**9
LORA = LoraSettings(r=16)
SHAPES = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32),
          "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80)}
FSDP = ("zero2", "zero3", "zero3-offload")


def llama(shape: str) -> LlamaConfig:
    return LlamaConfig(**SHAPES[shape], num_attention_heads=SHAPES[shape]["hidden_size"] // 128, num_key_value_heads=8,
                       vocab_size=128256, tie_word_embeddings=False)


def profile(shape: str):
    """The plan's own trace of the shape (search.plan_for_config's arguments: one trace a process)."""
    from bigfit.planning.profile import profile_model

    return profile_model(llama(shape), 1, 2048, 2048, "bf16", "cuda", lora=LORA)


def plan(shape: str, gpus: int, gb: int, four_bit: bool = True, strategies=None):
    from bigfit.planning.search import ALL, plan_for_config

    hw = Hardware(gpu_bytes=(gb * GB,) * gpus, cpu_ram=128 * GB)
    job = Workload(batch_size=gpus, seq_len=2048, micro_batch=1, checkpointing=True, lora=LORA, load_in_4bit=four_bit)
    return {c.estimate.name: c for c in plan_for_config(llama(shape), hw, job, strategies or ALL).candidates}


def test_fsdp_rows_fit_a_4bit_base_where_a_16bit_one_does_not():
    assert all(c.fits for n, c in plan("8b", 2, 24).items() if n != "zero2-offload-nvme")  # no NVMe described
    for shape, gb in (("8b", 12), ("70b", 80)):
        four, bf16 = plan(shape, 2, gb), plan(shape, 2, gb, four_bit=False, strategies=FSDP)
        assert four["zero3"].fits and four["zero3-offload"].fits and not bf16["zero3"].fits, (shape, four, bf16)
        assert four["zero3"].estimate.per_gpu["params"] < bf16["zero3"].estimate.per_gpu["params"] / 2
    # 70B on two 24 GB GPUs: zero3-offload, the base's rows in host RAM; or a device map computing
    # what the GPUs cannot hold on the host, scores of times slower
    rows = plan("70b", 2, 24)
    assert [n for n, c in rows.items() if c.fits] == ["zero3-offload", "device_map"]
    assert rows["device_map"].estimate.step_time_s > 20 * rows["zero3-offload"].estimate.step_time_s


def test_device_maps_and_stages_hold_whole_layers_in_nf4():
    """Every device of a map, every pipeline rank: its blocks' base layers in NF4, the other frozen
    parameters in bf16 (store_frozen), the adapters in fp32 with their moments, one layer dequantized
    at a time; a 4-bit base is made on the devices (no fp32 model on the host first)."""
    from bigfit.planning.search import plan_for_config

    prof, hw = profile("8b"), Hardware(gpu_bytes=(12 * GB,) * 2, cpu_ram=128 * GB)
    q, t = prof.quantized_params, prof.trainable_params
    want = quantized.STORED * q + 2 * (prof.params - q - t) + 4 * t
    for four_bit in (True, False):
        job = Workload(batch_size=2, seq_len=2048, micro_batch=2, checkpointing=True, lora=LORA, load_in_4bit=four_bit,
                  chunks=2)
        result = plan_for_config(llama("8b"), hw, job, ("device_map", "pipeline"))
        rows = {c.estimate.name: c for c in result.candidates}
        devices = [d["parts"] for d in result.device_map["devices"].values()]
        held = sum(d["params"] for d in devices)
        if not four_bit:  # 16.2 GB with the base in bf16: more than the two 12 GB GPUs, the host takes blocks
            assert held == pytest.approx(want + (2 - quantized.STORED) * q, rel=1e-3)
            assert "cpu" in result.device_map["devices"]
            continue
        assert held == pytest.approx(want, rel=1e-3) and "cpu" not in result.device_map["devices"]
        # the balancer's per-device bytes (planning/automap.py Costs.per_device) hold the dequantisation's
        assert all(d["activations"] >= quantized.TORCHAO_TRANSIENT_BYTES * prof.largest_quantized for d in devices)
        stages = [r["parts"]["params"] for r in result.pipeline["devices"].values()]
        assert sum(stages) == pytest.approx(want, rel=0.02) and len(stages) == 2  # the head, embeddings: one each
        assert rows["device_map"].fits and rows["pipeline"].fits
        assert rows["device_map"].estimate.per_host["total"] == 0


def test_sharded_base_falls_with_the_ranks():
    from bigfit.planning.estimate import memory

    prof = profile("8b")
    assert (prof.unit_quantized, prof.nf4_ranks) == (prof.quantized_params // 32, 256)  # every block alike
    q, t = prof.quantized_params, prof.trainable_params
    rest = prof.params - q
    for w in (1, 2, 4, 8):
        hw = Hardware(gpu_bytes=(80 * GB,) * w, cpu_ram=512 * GB)
        gpu, _ = memory("zero3", prof, hw, 2, True, four_bit=True)
        # the adapters' fp32 shards and the other frozen parameters' bf16 ones aside
        base = gpu["params"] - (4 * t + 2 * (rest - t)) / w - quantized.LAYER_BYTES * prof.quantized_layers
        assert base * w == pytest.approx(quantized.STORED * q, rel=1e-6)
        # zero2 holds the whole model gathered through the step: the base in NF4, the rest in bf16
        gathered = memory("zero2", prof, hw, 2, True, four_bit=True)[0]["buffers"]
        assert quantized.STORED * q + 2 * rest < gathered < 2 * prof.params


def test_zero3_offload_keeps_the_base_on_the_host():
    from bigfit.planning.estimate import memory

    prof = profile("8b")
    hw = Hardware(gpu_bytes=(24 * GB,) * 2, cpu_ram=128 * GB)
    (gpu, host), (gpu3, _) = (memory(s, prof, hw, 2, True, four_bit=True) for s in ("zero3-offload", "zero3"))
    assert gpu["params"] == 0 and host["params"] == pytest.approx(2 * gpu3["params"], abs=2)  # both ranks' shards
    assert host["buffers"] == 0  # read and quantized a unit at a time: no whole fp32 model on the host
    q = prof.quantized_params
    t = prof.trainable_params
    assert host["params"] == pytest.approx(4 * t + 2 * (prof.params - q - t) + quantized.STORED * q, rel=1e-3)
    assert gpu["total"] < gpu3["total"] - gpu3["params"] + 1  # the GPU holds what zero3's does less its shards


def test_gathers_and_offload_copies_move_4bit_weights():
    from bigfit.planning.estimate import step_time

    prof = profile("8b")
    hw = Hardware(gpu_bytes=(24 * GB,) * 2, cpu_ram=128 * GB)
    q, link = prof.quantized_params, hw.intra_gbps * 1e9
    for name, gathers in (("zero2", 1), ("zero3", 2), ("zero3-offload", 2)):
        bf16, four = (step_time(name, prof, hw, 2, True, 4096, 1, four_bit=f) for f in (False, True))
        assert bf16["communication"] - four["communication"] == pytest.approx(gathers * (2 - quantized.STORED) * q / 2 / link)
    bf16, four = (step_time("zero3-offload", prof, hw, 2, True, 4096, 1, four_bit=f) for f in (False, True))
    # a frozen base goes up in bf16 (store_frozen), a 4-bit one in NF4
    assert bf16["pcie"] - four["pcie"] == pytest.approx(2 * (2 - quantized.STORED) * q / 2 / (hw.pcie_gbps * 1e9))


def test_fsdp_rows_dequantize_in_torchao_and_single_ddp_rows_are_unchanged():
    rows = {gpus: plan("8b", gpus, 24) for gpus in (1, 2)}
    # as before FSDP2 ran a 4-bit base: bitsandbytes' bytes and dequantisation (tests/test_planning_adapters.py)
    for (gpus, name), (total, step) in {(1, "single"): (10687397892, 0.38078333), (1, "ddp"): (10687397892, 0.38078333),
                                        (2, "ddp"): (10855170052, 0.38078333)}.items():
        e = rows[gpus][name].estimate
        assert (e.per_gpu["total"], e.step_time_s) == (pytest.approx(total, rel=1e-6), pytest.approx(step, rel=1e-6))
    e = plan("70b", 2, 80)["ddp"].estimate
    assert (e.per_gpu["total"], e.step_time_s) == (pytest.approx(50748481540, rel=1e-6), pytest.approx(2.04030777, rel=1e-6))
    for name in FSDP:  # the NF4Tensor dequantisation (adapters/nf4.py): 4 bytes a weight beside the gathered unit, 10.6 moved
        e = rows[2][name].estimate
        assert e.per_gpu["buffers"] >= quantized.TORCHAO_TRANSIENT_BYTES * 14336 * 4096
        assert e.costs["compute"] > rows[2]["ddp"].estimate.costs["compute"]


def test_layers_that_split_into_no_whole_blocks_are_refused():
    from bigfit.planning.search import plan_for_config
    from tiny import tiny_config

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000)
    for gpus, runnable in ((4, True), (3, False)):  # its layers hold 16 x 16,384 weights, in rows of 256 at least
        hw = Hardware(gpu_bytes=(80 * GB,) * gpus, cpu_ram=512 * GB)
        rows = plan_for_config(config, hw, Workload(batch_size=gpus, seq_len=128, lora=LORA, load_in_4bit=True)).candidates
        assert all(c.fits == runnable for c in rows if c.estimate.name in FSDP), [(c.estimate.name, c.why_not) for c in rows]
    hw = Hardware(gpu_bytes=(80 * GB,) * 2, cpu_ram=512 * GB)
    rows = plan_for_config(tiny_config("llama"), hw, Workload(batch_size=2, seq_len=32, lora=LORA, load_in_4bit=True))
    assert rows.recommended not in FSDP and all("whole blocks" in c.why_not for c in rows.candidates
                                                if c.estimate.name in FSDP)
    # on a CPU machine every row's layers are torchao's: whole blocks or nothing
    hw = Hardware(gpu_bytes=(8 * GB,) * 2, cpu_ram=512 * GB, device="cpu")
    rows = plan_for_config(tiny_config("llama"), hw, Workload(batch_size=2, seq_len=32, lora=LORA, load_in_4bit=True))
    assert all("whole blocks" in c.why_not for c in rows.candidates if c.estimate.name != "zero2-offload-nvme")  # no disk


def test_check_refuses_what_train_refuses_and_imports_no_library():
    from bigfit.errors import BigfitError

    before = {n: n in sys.modules for n in ("torchao", "bitsandbytes")}
    quantized.check(True, "bf16")
    for args in ((False, "bf16"), (True, "fp32"), (True, "bf16", {"tp": 2}), (True, "bf16", {"pp": 2})):
        with pytest.raises(BigfitError, match="--load-in-4bit"):
            quantized.check(*args)
    assert {n: n in sys.modules for n in before} == before and sys.modules.get("torchao", 0) is not None


def test_torchao_dequantisation_bytes_are_its_own():
    """The bytes torchao's NF4Tensor stores, and the dequantisation (bigfit's, adapters/nf4.py) moves and holds
    at once, read off the operators it dispatches (each kernel's inputs read, output written; a view reads its storage)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    pytest.importorskip("torchao")
    from bigfit.adapters.quantize import nf4

    _, to_nf4 = nf4()  # torchao's, with bigfit's dequantisation (adapters/nf4.py)

    class Live(TorchDispatchMode):
        live = peak = moved = 0
        alive: set = set()  # storages made inside the call (a view's is its base's)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            new = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tree_flatten(out)[0]
                   if isinstance(t, torch.Tensor)}
            new = {k: v for k, v in new.items() if k not in self.alive and k not in inputs}
            if new:  # a kernel ran
                read = sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
                           for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
                written = sum(s.nbytes() for s in new.values())
                self.moved += read + written
                self.live += written
                self.peak = max(self.peak, self.live)
                for k, s in new.items():
                    self.alive.add(k)
                    weakref.finalize(s, self.free, k, s.nbytes())
            return out

        def free(self, key, nbytes):
            self.alive.discard(key)
            self.live -= nbytes

    w = torch.randn(1024, 256, dtype=torch.bfloat16)
    q = to_nf4(w, quantized.BLOCK, quantized.BLOCK2)
    stored = sum(t.numel() * t.element_size() for t in (q.quantized_data, q.quantized_scalers, q.quantization_factor))
    assert stored / w.numel() == pytest.approx(quantized.STORED, rel=1e-3)
    inputs = {getattr(q, name).untyped_storage().data_ptr() for name in q.__tensor_flatten__()[0]}
    mode = Live()
    with mode:
        q.get_original_weight()
    print(f"dequantisation: {mode.moved / w.numel():.2f} bytes a weight moved, {mode.peak / w.numel():.2f} held")
    assert mode.peak / w.numel() == pytest.approx(quantized.TORCHAO_TRANSIENT_BYTES, rel=0.01)
    assert mode.moved / w.numel() == pytest.approx(quantized.TORCHAO_DEQUANT_BYTES, rel=0.02)

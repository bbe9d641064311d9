"""The host's cost of issuing kernels in the planner's step times (planning/hostcost.py): the trace's
operator counts, the floor they put under every row's compute (data parallel, device-map devices,
pipeline chunks), compiled blocks, `bigfit plan --calibrate`'s measured figure in the cache, and the
NVMe disk `--strategy auto` sees."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from bigfit.machine.hardware import DEFAULTS, Hardware, calibrated_host_op_us, host_figures, host_notes
from bigfit.planning.workload import Workload

GB = 10**9


def small_llama(layers: int = 4):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000)


def test_operators_are_counted_per_block_whatever_the_batch():
    from transformers import T5Config

    from bigfit.planning.profile import profile_model

    small = profile_model(small_llama(), 1, 16, 0, "bf16")
    large = profile_model(small_llama(), 8, 256, 0, "bf16")
    assert small.block_ops == large.block_ops  # the count, not the size
    assert abs(small.other_ops - large.other_ops) <= 2  # (batch 1 skips one reshape of the loss)
    assert len(set(small.block_ops)) == 1 and 50 < small.block_ops[0] < 1000 and small.other_ops > 0
    mixed = profile_model(small_llama(), 1, 16, 0, "bf16", autocast=True)
    assert mixed.block_ops[0] > small.block_ops[0]  # autocast's casts are operators too...
    from bigfit.planning.automap import profile_for

    # ...but the plain trace's are the unit `--calibrate` prices: device maps and pipelines issue those
    split = profile_for(small_llama(), Workload(batch_size=1, seq_len=16, precision="bf16"))
    assert (split.block_ops, split.other_ops) == (small.block_ops, small.other_ops)
    assert split.block_saved == mixed.block_saved  # its memory: autocast's
    t5 = profile_model(T5Config(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=3,
                                vocab_size=384), 1, 16, 16, "bf16")
    encoder, decoder = t5.block_ops[1], t5.block_ops[-1]
    assert decoder > encoder  # cross-attention


def _single(hw, job, config=None):
    from bigfit.planning.search import plan_for_config

    return plan_for_config(config or small_llama(), hw, job, strategies=("single",)).candidates[0].estimate


def test_a_small_step_is_bound_by_the_host_issuing_it():
    from bigfit.planning.hostcost import step_seconds
    from bigfit.planning.profile import profile_model

    hw = Hardware(gpu_bytes=(80 * GB,))
    job = Workload(batch_size=4, seq_len=64, micro_batch=1)  # 4 micro-batches of one sample: a few GFLOPs
    e = _single(hw, job)
    prof = profile_model(small_llama(), 1, 64, 0, "bf16")  # the plain trace's operators: casts are the dispatcher's
    issue = step_seconds(prof, hw, job, passes=4)
    assert issue == pytest.approx(4 * (sum(prof.block_ops) + prof.other_ops) * hw.host_op_us * 1e-6)
    assert e.bottleneck == "host issue" and e.costs["compute"] < issue / 10
    assert e.step_time_s == pytest.approx(issue)
    faster = _single(replace(hw, host_op_us=hw.host_op_us / 2), job)
    assert faster.step_time_s == pytest.approx(issue / 2)
    # compiled blocks issue less (hostcost.COMPILED, measured: 0.54-0.67 of eager)
    assert _single(hw, replace(job, compile=True)).step_time_s < issue * 0.7
    assert _single(hw, replace(job, checkpointing=True)).step_time_s > issue  # the recompute issues again


def test_many_small_pipeline_chunks_lose_to_data_parallel_on_t5_3b():
    """t5-3b on eight 16 GB GPUs, 8 x 128/128 tokens: an 8-stage pipeline of 8 one-sample chunks issues
    every stage's kernels 8 times a step, far above its GPU time; ZeRO wins (before the host term the
    plan predicted 0.017 s for the pipeline and recommended it)."""
    from transformers import T5Config

    from bigfit.planning.search import plan_for_config

    t5_3b = T5Config(d_model=1024, d_ff=16384, d_kv=128, num_heads=32, num_layers=24, vocab_size=32128)
    hw = Hardware(gpu_bytes=(16 * GB,) * 8, cpu_ram=256 * GB)
    p = plan_for_config(t5_3b, hw, Workload(batch_size=8, seq_len=128, target_len=128),
                        strategies=("zero2", "zero3", "pipeline"))
    by = {c.estimate.name: c.estimate for c in p.candidates}
    assert by["zero2"].bottleneck == "host issue"
    assert by["pipeline"].step_time_s > 8 * 6 * 100 * hw.host_op_us * 1e-6  # 8 chunks of 6 blocks, ~200 operators each
    assert p.recommended in ("zero2", "zero3") and by["pipeline"].step_time_s > by["zero2"].step_time_s


def test_calibration_is_kept_per_device_and_used(tmp_path, monkeypatch, capsys):
    from bigfit.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibrated_host_op_us("cpu") is None
    model = tmp_path / "m"
    small_llama(2).save_pretrained(model)
    assert main(["plan", "--calibrate", "--model", str(model), "--gpus", "2x16GB", "--batch-size", "2",
                 "--seq-len", "16", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("calibrated: the host issues a forward operator with its backward in ")
    assert "its Adam step takes G parameters/s: torch fused " in out and ", int8 " in out
    record = json.loads((tmp_path / "bigfit" / "host.json").read_text())["cpu"]
    assert record["host_op_us"] > 0 and record["operators"] > 100 and record["torch"]
    assert 0.1 < record["forward_share"] < 0.9 and record["compiled"] is False  # forward and backward both issue
    assert set(record["host_adam"]) == {"torch", "fp32", "bf16", "int8"} and min(record["host_adam"].values()) > 1e6
    assert calibrated_host_op_us("cpu") == pytest.approx(record["host_op_us"])
    assert calibrated_host_op_us("cuda") is None  # a CPU's figure never stands in for a GPU host's
    figures = host_figures("cpu")  # what a job on this CPU machine plans with
    assert figures["cpu_adam_params_per_s"] == pytest.approx(record["host_adam"]["torch"])
    kernel = {f: record["host_adam"][f] for f in ("fp32", "bf16", "int8")}
    assert dict(figures["host_adam_rates"]) == pytest.approx(kernel)
    assert "host Adam G parameters/s (calibrated): torch fused: " in " ".join(host_notes("cpu"))
    assert host_figures("cuda") == {"host_op_us": DEFAULTS["host_op_us"], "host_adam_rates": ()}
    (tmp_path / "bigfit" / "host.json").write_text("{not json")
    assert calibrated_host_op_us("cpu") is None  # unreadable: the defaults stand
    assert host_figures("cpu") == {"host_op_us": DEFAULTS["host_op_us"], "host_adam_rates": ()}
    assert DEFAULTS["host_op_us"] > 0


def test_the_engines_host_step_takes_the_measured_rate_of_its_format():
    """Calibrated, a format's host step is its measured rate (fp32 gradients cost their extra bytes);
    without, the fp32 kernel's bytes against torch's fused rate, times the format's speed against it
    measured on a 16-core host (bf16 faster, int8 slower, neither by its bytes)."""
    from bigfit.planning.estimate import FORMAT_SPEED, host_adam_rate, host_step_bytes

    plain = Hardware(gpu_bytes=(80 * GB,), cpu_adam_params_per_s=4e9)
    assert host_adam_rate(plain, 2, "fp32") == pytest.approx(4e9 * 40 / 32)
    assert host_adam_rate(plain, 2, "int8") == pytest.approx(4e9 * 40 / 32 * FORMAT_SPEED["int8"])
    assert host_adam_rate(plain, 2, "int8") < 4e9
    assert 4e9 * 40 / 32 < host_adam_rate(plain, 2, "bf16") < 4e9 * 40 / host_step_bytes(2, "bf16")
    assert host_adam_rate(replace(plain, cpu_adam_kernel=False), 4) == pytest.approx(4e9 * 0.8)
    measured = replace(plain, host_adam_rates=(("bf16", 1.6e9), ("int8", 1e9)))
    assert host_adam_rate(measured, 2, "int8") == pytest.approx(1e9)
    fp32_grads = host_step_bytes(4, "int8") / host_step_bytes(2, "int8")  # fp32 gradients: 4 bytes more to read
    assert host_adam_rate(measured, 4, "int8") == pytest.approx(1e9 / fp32_grads)
    assert host_adam_rate(measured, 2, "fp32") == host_adam_rate(plain, 2, "fp32")  # not measured: by its bytes
    no_kernel = dict(cpu_adam_kernel=False)  # torch's step stands in: the kernel's rates do not apply
    assert host_adam_rate(replace(measured, **no_kernel), 4) == host_adam_rate(replace(plain, **no_kernel), 4)


def test_host_op_us_flag_overrides(tmp_path, capsys):
    from bigfit.cli import main

    model = tmp_path / "m"
    small_llama(2).save_pretrained(model)
    steps = []
    for us in ("25", "50"):
        assert main(["plan", "--model", str(model), "--gpus", "1x16GB", "--batch-size", "1", "--seq-len", "16",
                     "--host-op-us", us, "--json"]) == 0
        rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["strategies"]}
        steps.append(rows["single"]["step_time_s"])
    assert steps[1] == pytest.approx(2 * steps[0], rel=1e-3)
    assert main(["plan", "--model", str(model), "--gpus", "1x16GB", "--host-op-us", "0"]) == 2
    assert "--host-op-us must be more than 0, got 0.0" in capsys.readouterr().err


def test_auto_sees_the_nvme_tiers_disk_and_fills_ram_with_states(tmp_path, model_dirs):
    from bigfit.machine.calibration import disk
    from bigfit.settings.config import TrainConfig
    from bigfit.models.source import build_model, count_parameters, load_config, locate
    from bigfit.job import autoplan as auto
    from bigfit.planning.estimate import PROCESS_BYTES

    cfg = TrainConfig(model=str(model_dirs["llama"]), output_dir=str(tmp_path / "out"), batch_size=2, micro_batch_size=1)
    p = auto._auto(cfg, 1, ("zero2-offload-nvme", "device_map"), None)
    free, gbps = disk(str(tmp_path / "out" / "nvme"))  # measured once per filesystem, then from the cache
    hw = auto._this_machine(1, nvme_dir=str(tmp_path / "out" / "nvme"))
    assert gbps > 0 and hw.nvme_gbps == gbps and 0 < hw.nvme <= free
    assert hw.notes[-1].startswith(f"NVMe tier at {tmp_path / 'out' / 'nvme'}: ") and "NVMe" in p.hardware
    nvme = {c.estimate.name: c for c in p.candidates}["zero2-offload-nvme"]
    assert nvme.fits, nvme.why_not  # the disk is described: its states have room
    assert not (tmp_path / "out").exists()  # measuring the disk leaves nothing behind
    src = locate(cfg.model)
    host, n = nvme.estimate.per_host, count_parameters(build_model(src, load_config(src), 0, on_meta=True))
    assert host["optimizer"] == pytest.approx(min(12 * n, 0.9 * hw.cpu_ram - host["grads"] - PROCESS_BYTES))
    assert auto.nvme_host_gb(cfg, 1) == pytest.approx(host["optimizer"] / 1e9)


def test_a_smaller_card_is_simulated_by_bigfit_gpu_memory(monkeypatch):
    from bigfit.errors import BigfitError
    from bigfit.common.units import gpu_cap

    assert gpu_cap() is None
    monkeypatch.setenv("BIGFIT_GPU_MEMORY", "24GB")
    assert gpu_cap() == 24 * GB
    monkeypatch.setenv("BIGFIT_GPU_MEMORY", "a lot")
    with pytest.raises(BigfitError, match="BIGFIT_GPU_MEMORY 'a lot' is not a size; write it like 24GB"):
        gpu_cap()
    monkeypatch.setenv("BIGFIT_GPU_MEMORY", "0GB")
    with pytest.raises(BigfitError, match="BIGFIT_GPU_MEMORY '0GB' holds nothing"):
        gpu_cap()


def test_a_named_nvme_tier_keeps_in_ram_what_the_ram_leaves_unless_told(tmp_path, model_dirs, pairs_file, capsys):
    """`--strategy zero2-offload-nvme` without --nvme-host-gb keeps in RAM the states the plan leaves room
    for (a tiny model's: all of them, no file written), as --strategy auto does; 0 puts every one in files."""
    from bigfit.cli import main

    args = ["train", "--model", str(model_dirs["llama"]), "--data", str(pairs_file), "--strategy", "zero2-offload-nvme",
            "--nproc", "1", "--max-steps", "1", "--batch-size", "2", "--eval-samples", "0", "--no-consolidate"]
    assert main([*args, "--output-dir", str(tmp_path / "filled")]) == 0
    assert re.search(r"--nvme-host-gb 0\.000\d+: the optimizer states host RAM holds", capsys.readouterr().out)
    assert not list((tmp_path / "filled" / "nvme").rglob("*.bin"))
    assert main([*args, "--output-dir", str(tmp_path / "files"), "--nvme-host-gb", "0"]) == 0
    assert list((tmp_path / "files" / "nvme").rglob("*.bin"))

"""Composed plans (planning/layouts.py, composed.py): per-GPU bytes of tensor, pipeline and data
parallelism combined, the search over every factorisation of the world, its recommendation beside
the named strategies, and `bigfit plan --tp/--pp/--dp-shard/--dp-replicate`. Pure: nothing runs."""
from __future__ import annotations

import json
import math
import re

import pytest

from bigfit.machine.hardware import Hardware
from bigfit.settings.config import STRATEGIES
from tiny import tiny_config

GB = 10**9
NOT_OFFLOAD = ("ddp", "zero1", "zero2", "zero3")


def traced(family: str, micro: int, seq: int = 64, target: int = 16):
    from bigfit.planning.profile import profile_model

    return profile_model(tiny_config(family), micro, seq, target if family == "t5" else 0, "bf16", "cuda")


def rows(prof, gpus: int, job, nodes: int = 1, named=(), **fixed):
    """The plan of `job` on `gpus` 80 GB GPUs per node: by name, the named rows and the composed ones."""
    from bigfit.planning.search import plan

    p = plan(prof, Hardware(gpu_bytes=(80 * GB,) * gpus, nodes=nodes, cpu_ram=2000 * GB), job, named, layouts=fixed)
    return p, {c.estimate.name: c for c in p.candidates + p.layouts}


@pytest.fixture(scope="module")
def llama():
    return traced("llama", 4)


def test_tp_halves_the_block_states_embeddings_head_and_logits_and_keeps_the_norms_whole(llama):
    """tp2 (one rank of two, no data parallelism) against single on one GPU at the same micro-batch:
    the blocks' split parameters halve, and so do the embeddings and head (split by vocabulary);
    norms stay whole, and so do the activations TP does not divide (the residual stream, norms'
    inputs). The logits and the loss's fp32 tensors halve."""
    from bigfit.planning.composed import share
    from bigfit.planning.search import Workload

    job = Workload(batch_size=4, micro_batch=4, seq_len=64)
    _, one = rows(llama, 1, job, named=("single",))
    _, two = rows(llama, 2, job)
    single, tp2 = one["single"].estimate.per_gpu, two["tp2"].estimate.per_gpu
    blocks, split = sum(llama.block_params), sum(llama.block_tp_params)
    assert split > 0.99 * blocks  # block norms are all the blocks keep whole
    vocab = llama.vocab_params
    assert vocab == llama.embedding_params + llama.head_params  # untied: both split
    replicated = 4 * (llama.root_params - vocab)  # the final norm
    assert tp2["params"] == int(replicated + 4 * (vocab / 2 + blocks - split / 2))
    assert tp2["params"] == pytest.approx((single["params"] - replicated) / 2 + replicated, rel=0.01)
    assert tp2["optimizer"] == pytest.approx(2 * tp2["params"], abs=2)
    kept = sum(llama.block_saved) - sum(llama.block_tp_saved)
    assert 0 < kept < sum(llama.block_saved)
    rank = share(llama, 2, 1.0)
    assert (rank.logits_bytes, rank.loss_saved) == (llama.logits_bytes / 2, llama.loss_saved / 2)
    assert single["activations"] - tp2["activations"] == pytest.approx(
        sum(llama.block_tp_saved) / 2 + llama.loss_saved / 2, abs=2)


def test_sequence_parallelism_divides_the_norms_and_residual_stream_too(llama):
    """Under --sequence-parallel a tp-2 rank keeps half of what TP alone keeps whole in each block (norm
    inputs, the residual stream), but not the column-parallel layers' gathered inputs; the composed
    rows carry it (`tp2 (sp)`)."""
    from bigfit.planning.composed import share
    from bigfit.planning.search import Workload

    sp, tp = share(llama, 2, 1.0, sequence=True), share(llama, 2, 1.0)
    for a, b, s in zip(sp.block_saved, tp.block_saved, llama.block_sp_saved):
        assert a == pytest.approx(b - s / 2) and s > 0
    whole = [a - d - s for a, d, s in zip(llama.block_saved, llama.block_tp_saved, llama.block_sp_saved)]
    assert all(w > 0 for w in whole)  # q/k/v's and gate/up's gathered inputs
    job = Workload(batch_size=4, micro_batch=4, seq_len=64, sequence_parallel=True)
    _, by = rows(llama, 2, job)
    assert by["tp2 (sp)"].estimate.per_gpu["activations"] < rows(llama, 2, Workload(batch_size=4, micro_batch=4, seq_len=64))[1][
        "tp2"].estimate.per_gpu["activations"]
    assert not llama.sp_error and not traced("gpt2", 4).sp_error


def test_a_vocabulary_the_degree_does_not_divide_stays_whole():
    """T5 with 386 rows at tp 4: embeddings, head and logits whole on every rank; at tp 2 halved."""
    from bigfit.planning.composed import share
    from bigfit.planning.profile import profile_model

    cfg = tiny_config("t5")
    cfg.vocab_size = 386
    t5 = profile_model(cfg, 4, 64, 16, "bf16", "cuda")
    assert t5.vocab_rows == 386 and t5.vocab_params == t5.embedding_params  # tied: one tensor
    four, two = share(t5, 4, 1.0), share(t5, 2, 1.0)
    assert (four.logits_bytes, four.embedding_params, four.root_params) == \
        (t5.logits_bytes, t5.embedding_params, t5.root_params)
    assert (two.logits_bytes, two.embedding_params) == (t5.logits_bytes / 2, t5.embedding_params / 2)


def test_fsdp_over_tp_shards_by_both_and_pipeline_over_dp_too(llama):
    """dp_shard4 x tp2 (zero3): the TP rank's states sharded four ways. pp2 x dp_shard2: a position's
    stage (layout/cut.py's cut) sharded two ways: its parameters and optimizer states half of those
    of pp2 x dp_replicate2 (DDP), which hold the fuller position whole."""
    from bigfit.planning.search import Workload

    _, by = rows(llama, 8, Workload(batch_size=16, micro_batch=2, seq_len=64))
    share = llama.params - (sum(llama.block_tp_params) + llama.vocab_params) / 2  # one TP rank's parameters
    assert by["dp_shard4 x tp2 (zero3)"].estimate.per_gpu["params"] == int(4 * share / 4)
    _, by = rows(llama, 4, Workload(batch_size=8, micro_batch=2, seq_len=64))
    ddp, zero3 = by["pp2 x dp_replicate2 (ddp)"].estimate.per_gpu, by["pp2 x dp_shard2 (zero3)"].estimate.per_gpu
    emb, head = llama.embedding_params, llama.head_params  # untied: embeddings with block 0, the head with the last
    fuller = max(llama.block_params[0] + emb, llama.params - llama.block_params[0] - emb)
    assert ddp["params"] == 4 * fuller and ddp["optimizer"] == 8 * fuller and head > 0
    assert zero3["params"] == pytest.approx(ddp["params"] / 2, abs=1)
    assert zero3["optimizer"] == pytest.approx(ddp["optimizer"] / 2, abs=1)


def test_hsdp_per_gpu_bytes_equal_those_of_dp_shard_alone(llama):
    """HSDP (dp_replicate 2 x dp_shard 4 on 8 GPUs) holds what zero3 / zero2 over 4 GPUs hold, at the
    same micro-batch: the replicas divide the batch, not the states."""
    from bigfit.planning.search import Workload

    _, eight = rows(llama, 8, Workload(batch_size=16, micro_batch=2, seq_len=64))
    _, four = rows(llama, 4, Workload(batch_size=8, micro_batch=2, seq_len=64), named=("zero2", "zero3"))
    for kind in ("zero2", "zero3"):
        assert eight[f"dp_replicate2 x dp_shard4 ({kind})"].estimate.per_gpu == four[kind].estimate.per_gpu


def check_invariants(p, prof, world: int, per_node: int, batch: int) -> None:
    from bigfit.layout.plan import DIMS

    assert p.layouts, "no composed plan rated"
    heads = prof.tp_counts["attention heads"]
    for c in p.layouts:
        d = c.degrees
        assert math.prod(d[k] for k in DIMS) == world, c.estimate.name
        assert heads % d["tp"] == 0 and per_node % d["tp"] == 0 and d["pp"] <= prof.n_blocks
        assert batch % (d["dp_replicate"] * d["dp_shard"]) == 0
        assert not (d["tp"] == d["pp"] == 1 and world in (d["dp_shard"], d["dp_replicate"] * (c.plan.zero == 0)))
    assert len({c.estimate.name for c in p.layouts}) == len(p.layouts)  # one row per distinct plan


def test_every_rated_plan_multiplies_to_the_world_and_tp_divides_the_heads():
    from bigfit.planning.search import Workload

    prof = traced("t5", 1)
    p, _ = rows(prof, 8, Workload(batch_size=16, seq_len=64, target_len=16), nodes=2, named=STRATEGIES)
    check_invariants(p, prof, 16, 8, 16)
    groups = {r.group for r in p.layout_rejected}
    assert any(g.startswith("tp must divide the model's attention heads (4)") for g in groups)
    assert "more pipeline stages than the model's 5 blocks" in groups


@pytest.fixture(scope="module")
def llama70b():
    """A Llama-3-70B-class config on the meta device (fake tensors), traced as the planner traces it
    for 8 x 4096 tokens on 8 or more GPUs: micro-batch 1."""
    from transformers import LlamaConfig

    from bigfit.planning.profile import profile_model

    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    return profile_model(config, 1, 4096, 0, "bf16", "cuda")


def test_70b_fits_only_composed_and_only_on_enough_gpus(llama70b):
    """On 8 x 80 GB nothing fits without offload, composed or named: AdamW's fp32 states alone are 16
    bytes a parameter, 141 GB per GPU however the 70.6B parameters are spread over 8. On 8 nodes (64
    GPUs) zero3 still holds every block's activations of a 4096-token sample (~145 GB); with TP 8 a
    rank holds the residual stream and 1/8 of the rest, and a tp-8 plan is the one predicted to fit
    (by 0.9 GB, this trace's figure) and recommended."""
    from bigfit.planning.search import Workload

    job = Workload(batch_size=8, seq_len=4096, precision="bf16")
    assert 16 * llama70b.params / 8 > 80 * GB
    p, by = rows(llama70b, 8, job, named=STRATEGIES)
    assert not any(by[n].fits for n in NOT_OFFLOAD) and not any(c.fits for c in p.layouts)
    check_invariants(p, llama70b, 8, 8, 8)
    p, by = rows(llama70b, 8, job, nodes=8, named=STRATEGIES)
    check_invariants(p, llama70b, 64, 8, 8)
    assert not any(by[n].fits for n in NOT_OFFLOAD)
    fits = [c for c in p.layouts if c.fits]
    assert fits and all(c.plan.tp == 8 for c in fits)
    assert p.layout_pick is fits[0] and "fits where no named strategy does" in p.layout_reason
    tp8 = fits[0].estimate.per_gpu["activations"]
    assert tp8 < 0.5 * by["zero3"].estimate.per_gpu["activations"]


def test_tiny_t5_on_two_gpus_still_takes_a_named_strategy(model_dirs, monkeypatch):
    from bigfit.settings.config import TrainConfig
    from bigfit.layout.plan import plan_for
    from bigfit.job import autoplan as auto
    from bigfit.planning.search import ALL, Workload, plan_for_config

    hw = Hardware(gpu_bytes=(80 * GB,) * 2)
    p = plan_for_config(tiny_config("t5"), hw, Workload(batch_size=8, seq_len=64, target_len=16), layouts={})
    assert p.layouts and p.recommended in ALL and p.layout_pick is None
    assert "must beat the fastest named one" in p.layout_reason
    monkeypatch.setattr(auto, "_this_machine", lambda world, strategy=None, nvme_dir=None: hw)
    cfg = TrainConfig(model=str(model_dirs["t5"]), strategy="auto", batch_size=8, max_source_len=32)
    name, degrees, reason = auto.auto_plan(cfg, 2, one_process=False)
    assert name in ALL and "composed plans:" in reason
    assert plan_for(name, 2, **degrees).name == name and set(degrees) == {"pp", "dp_replicate", "dp_shard", "cp", "tp"}


def test_plan_command_restricts_the_search_to_the_degrees_given(model_dirs, capsys):
    from bigfit.cli import main

    args = ["plan", "--model", str(model_dirs["llama"]), "--gpus", "8x80GB", "--tp", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "composed plans with tp 2" in out
    table = out.split("composed plans with tp 2", 1)[1].split("degrees in mesh order", 1)[0]
    names = re.findall(r"^│ (\S[^│]*?)\s*│ (?:yes|no)", table, flags=re.M)
    assert names and all("tp2" in n for n in names)
    assert main([*args, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["composed"] and all(c["degrees"]["tp"] == 2 for c in p["composed"])
    assert {"strategy", "degrees", "zero", "pipeline"} <= set(p["composed"][0])
    assert all("tp2" in r["name"] for r in p["composed_rejected"])
    assert set(p["strategies"][0]) == {"name", "fits", "per_gpu_bytes", "per_host_bytes", "step_time_s",
                                       "tokens_per_s", "bottleneck", "why_not", "per_node_nvme_bytes",
                                       "optimizer_states", "activations", "checkpoint_blocks"}


@pytest.mark.parametrize("flags, named", [(["--tp", "3"], "--tp 3"), (["--tp", "4"], "--tp 4"),
                                          (["--pp", "2", "--dp-shard", "8"], "= 16"), (["--pp", "8"], "--pp 8")])
def test_plan_command_refuses_degrees_that_cannot_be(model_dirs, capsys, flags, named):
    """Not a divisor of the 8 GPUs; not of the tiny Llama's 2 KV heads; a product over 8; more stages
    than its 2 blocks: one error line naming the value, status 2."""
    from bigfit.cli import main

    assert main(["plan", "--model", str(model_dirs["llama"]), "--gpus", "8x80GB", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0]


def test_pipeline_with_zero1_or_the_offload_engine_moves_optimizer_states_off_each_stage(llama):
    """pp2 x dp_shard2 under zero1 holds half of DDP's optimizer states per position; under the offload
    engine a position keeps bf16 parameters and fp32 accumulators on the GPU and no optimizer states,
    its fp32 master rows and moments (12 bytes a parameter, over dp_shard 2) in host RAM, and pays
    the host step and the PCIe copies after the schedule."""
    from bigfit.planning.search import Workload

    _, by = rows(llama, 4, Workload(batch_size=8, micro_batch=2, seq_len=64))
    ddp, zero1 = by["pp2 x dp_replicate2 (ddp)"].estimate, by["pp2 x dp_shard2 (zero1)"].estimate
    offload = by["pp2 x dp_shard2 (zero2-offload)"].estimate
    assert zero1.per_gpu["optimizer"] == pytest.approx(ddp.per_gpu["optimizer"] / 2, abs=2)
    assert offload.per_gpu["optimizer"] == 0 and offload.per_gpu["params"] <= ddp.per_gpu["params"] / 2  # bf16, not fp32
    assert offload.per_gpu["total"] < zero1.per_gpu["total"] < ddp.per_gpu["total"]
    n = ddp.per_gpu["params"] / 4  # the fuller position's parameters
    assert offload.per_host["optimizer"] == pytest.approx(12 * n / 2 * 4, rel=1e-6)  # 4 ranks on the node
    assert offload.costs["cpu_optimizer"] > 0 and offload.costs["pcie"] > 0
    assert "pp2 x dp_shard2 (zero2-offload-nvme)" not in by  # its NVMe tier over stages is not rated
    # zero3-offload over stages: nothing of the states on the GPU; fp32 shards, gradients and moments
    # (16 bytes a parameter) of the fuller position over dp_shard 2 in host RAM; shards up for each chunk
    z3o = by["pp2 x dp_shard2 (zero3-offload)"].estimate
    assert (z3o.per_gpu["params"], z3o.per_gpu["grads"], z3o.per_gpu["optimizer"]) == (0, 0, 0)
    assert z3o.per_host["params"] + z3o.per_host["grads"] + z3o.per_host["optimizer"] == \
        pytest.approx(16 * n / 2 * 4, rel=1e-6)
    assert z3o.costs["pcie"] > 0 and z3o.costs["cpu_optimizer"] > 0

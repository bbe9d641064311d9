"""How the planner rates keeping activations for long sequences (planning/keeping.py, longest.py):
selective checkpointing between keep and checkpoint, the chunked loss, activation offload, context
parallel rows, --activations auto's choice (the gpt-neo-1.3B case), `bigfit plan --max-seq-len`, and
the issue's Llama-3-8B at 64K tokens on 8 x 80 GB. Pure: models on fake tensors, nothing runs."""
from __future__ import annotations

import dataclasses
import json

import pytest

from bigfit.machine.hardware import Hardware
from tiny import tiny_config

GB = 10**9


def llama(layers: int = 6):
    cfg = tiny_config("llama")
    cfg.num_hidden_layers = layers
    return cfg


@pytest.fixture(scope="module")
def six():
    from bigfit.planning.profile import profile_model

    return profile_model(llama(), 2, 128, 0, "bf16", "cuda")


def rated(prof, job, name="zero3", gpus=1, **hw):
    from bigfit.planning.search import plan

    machine = Hardware(gpu_bytes=(80 * GB,) * gpus, cpu_ram=2000 * GB, **hw)
    return {c.estimate.name: c for c in plan(prof, machine, job, (name,)).candidates}[name].estimate


def test_selective_checkpointing_lies_between_keep_and_checkpoint(six):
    """The first k blocks checkpointed: memory falls and time grows with k, from keep (k 0) to every
    block (k 6, the same figures as checkpointing all). Keeping the last block costs no more than
    checkpointing it: backward frees its activations before the first recompute (k 5 holds one input
    less than k 6)."""
    from bigfit.planning.search import Workload

    job = Workload(batch_size=2, seq_len=128)
    keep = rated(six, job)
    every = rated(six, dataclasses.replace(job, checkpointing=True))
    ks = [rated(six, dataclasses.replace(job, checkpointing=True, checkpoint_blocks=k)) for k in range(1, 7)]
    assert ks[-1].per_gpu == every.per_gpu and ks[-1].step_time_s == every.step_time_s
    acts = [keep.per_gpu["activations"]] + [e.per_gpu["activations"] for e in ks]
    steps = [keep.step_time_s] + [e.step_time_s for e in ks]
    assert all(a > b for a, b in zip(acts[:-1], acts[1:-1])) and acts[-1] - acts[-2] == six.block_inputs[0]
    assert all(a < b for a, b in zip(steps, steps[1:]))
    # three of six: the inputs of three, the saved bytes of the other three (the recompute comes after them)
    half = ks[2].per_gpu["activations"] - keep.per_gpu["activations"]
    assert half == pytest.approx(sum(six.block_inputs[:3]) - sum(six.block_saved[:3]), abs=8)


def test_a_chunked_loss_holds_one_chunks_logits_and_runs_the_head_again(six):
    """--loss-chunk: the loss's saved fp32 log-softmax and the logits' buffers of one chunk, not the whole;
    the head's matmul again in backward (2 x tokens x hidden x vocab FLOPs more)."""
    from bigfit.planning.keeping import chunk_loss
    from bigfit.planning.search import Workload

    job = Workload(batch_size=2, seq_len=128, loss_chunk=64)
    whole, chunked = rated(six, dataclasses.replace(job, loss_chunk=0)), rated(six, job)
    assert whole.per_gpu["activations"] - chunked.per_gpu["activations"] == pytest.approx(
        six.loss_saved * (1 - 64 / 256), abs=8)
    assert chunked.costs["compute"] > whole.costs["compute"]  # (the tiny model's step is its host's issuing)
    c = chunk_loss(six, job, 256)
    assert c.flops_per_token - six.flops_per_token == pytest.approx(2 * six.head_params)
    assert (c.logits_numel, c.head_flops_again) == (six.logits_numel / 4, 2 * six.head_params)
    assert chunk_loss(six, dataclasses.replace(job, loss_chunk=None), 256) is six  # auto: 1 GiB of fp32 logits first


def test_offload_keeps_two_inputs_on_the_gpu_and_copies_beside_compute(six):
    """--activations offload: the checkpointed inputs in host RAM (every GPU's of the node) but for two in
    flight; the copies (twice the bytes over PCIe) overlap compute: the step is the larger of the two."""
    from bigfit.planning.search import Workload

    job = Workload(batch_size=2, seq_len=128, checkpointing=True)
    ck, off = rated(six, job, gpus=2), rated(six, dataclasses.replace(job, offload_activations=True), gpus=2)
    inputs = sum(six.block_inputs)
    assert ck.per_gpu["activations"] - off.per_gpu["activations"] == pytest.approx(
        inputs - 2 * max(six.block_inputs), abs=8)
    assert off.per_host["activations"] - ck.per_host["activations"] == pytest.approx(2 * inputs, abs=8)
    assert off.costs["activation offload"] == pytest.approx(2 * inputs / (Hardware(gpu_bytes=(GB,)).pcie_gbps * 1e9))
    assert off.step_time_s == pytest.approx(ck.step_time_s)  # hidden under compute
    slow = rated(six, dataclasses.replace(job, offload_activations=True), gpus=2, pcie_gbps=1e-6)
    assert slow.step_time_s == pytest.approx(slow.costs["activation offload"])
    assert slow.bottleneck == "activation offload"


def test_context_parallel_rows_split_the_sequence_and_gather_keys_and_values(six):
    """With context parallelism rated, cp rows join the composed plans: a rank holds half of every
    sequence's activations plus the keys and values it gathered, FSDP2 shards over dp_shard x cp (the
    states of dp_shard2 x cp2 are zero3's over 4), and the gathers cost time; T5 has none."""
    from bigfit.planning.keeping import gathered_kv
    from bigfit.planning.search import Workload, plan

    hw = Hardware(gpu_bytes=(80 * GB,) * 4, cpu_ram=2000 * GB)
    job = Workload(batch_size=4, micro_batch=2, seq_len=128, context_parallel=True)
    p = plan(six, hw, job, ("zero3",), layouts={})
    by = {c.estimate.name: c.estimate for c in p.candidates + p.layouts}
    cp, zero3 = by["dp_shard2 x cp2 (zero3)"], by["zero3"]
    assert cp.per_gpu["params"] == zero3.per_gpu["params"] and cp.per_gpu["optimizer"] == zero3.per_gpu["optimizer"]
    kv = gathered_kv(six, 1, 2, 2) * six.n_blocks
    assert cp.per_gpu["activations"] == pytest.approx(zero3.per_gpu["activations"] / 2 + kv, rel=0.02)
    assert cp.costs["context parallel"] > 0
    off = plan(six, hw, dataclasses.replace(job, context_parallel=False), ("zero3",), layouts={})
    assert off.layouts and not any(c.plan.cp > 1 for c in off.layouts)  # a job built by hand: none unless asked
    from bigfit.planning.profile import profile_model

    t5 = profile_model(tiny_config("t5"), 2, 64, 16, "bf16", "cuda")
    p = plan(t5, hw, Workload(batch_size=4, micro_batch=2, seq_len=64, target_len=16), (), layouts={"cp": 2})
    assert not p.layouts and {r.group for r in p.layout_rejected} == {"context parallelism splits decoder-only models' "
                                                                      "sequences"}


def test_the_planner_job_takes_the_activations_settings(model_dirs):
    """--activations auto lets each row choose; an explicit --activations, or --activation-checkpointing
    (checkpoint), fixes the way for every row."""
    from bigfit.job.autoplan import planner_job
    from bigfit.models.source import load_config, locate
    from bigfit.settings.config import TrainConfig

    config = load_config(locate(str(model_dirs["llama"])))
    job = lambda **kw: planner_job(TrainConfig(model=str(model_dirs["llama"]), **kw), config, 2)  # noqa: E731
    assert job().choose_activations and not job().checkpointing and job().context_parallel
    forced = job(activation_checkpointing=True)
    assert forced.checkpointing and not forced.choose_activations and forced.keeping == "checkpoint"
    off = job(activations="offload", checkpoint_blocks=1, loss_chunk=0)
    assert (off.keeping, off.loss_chunk, off.choose_activations) == ("offload 1 blocks", 0, False)


@pytest.fixture()
def gpt_neo(tmp_path, monkeypatch):
    """gpt-neo-1.3B's public shape (config only), on one GPU capped at 16 GB (BIGFIT_GPU_MEMORY's
    `bigfit train` on an H100 sees one such card), 125 GiB of host RAM. Its attention kinds alternate,
    global and local: the trace runs every block (profile.py), which costs this test its 2-3 s."""
    from transformers import GPTNeoConfig

    from bigfit.job import autoplan

    GPTNeoConfig(hidden_size=2048, num_layers=24, num_heads=16, attention_types=[[["global", "local"], 12]],
                 vocab_size=50257, max_position_embeddings=2048, window_size=256, embed_dropout=0.0,
                 attention_dropout=0.0, resid_dropout=0.0).save_pretrained(tmp_path)
    hw = Hardware(gpu_bytes=(16 * GB,), cpu_ram=125 * 2**30)
    monkeypatch.setattr(autoplan, "_this_machine", lambda *a, **k: hw)
    return tmp_path


def test_gpt_neo_on_16gb_trains_checkpointed_at_a_large_micro_batch(gpt_neo, capsys):
    """`bigfit train --strategy auto --batch-size auto` at 1024 tokens (benchmarks/probe_cases.py): kept,
    its activations allow one sample; checkpointed, tens, and the offload engine's host step is shared by
    them: --activations auto takes checkpointing at micro-batch 8 or more, and the decision is a concrete
    --activations before the job is resolved."""
    from bigfit.commands import decide
    from bigfit.job import autoplan
    from bigfit.job.resolution import resolve
    from bigfit.settings.config import TrainConfig

    cfg = TrainConfig(model=str(gpt_neo), strategy="auto", batch_size="auto", max_source_len=1024, precision="bf16",
                      nproc=1)
    picked = decide.auto_strategy(cfg, None, processes=1, one_process=True)
    assert picked.activations == "checkpoint" and picked.strategy.startswith("zero2-offload")
    assert "--activations auto -> checkpoint" in capsys.readouterr().out
    pred = autoplan.auto_micro_batch(picked, 1)
    assert pred.size >= 8
    kept = autoplan.auto_micro_batch(dataclasses.replace(picked, activations="keep", checkpoint_blocks=None), 1)
    assert kept.size <= 2 and pred.step_s / pred.size < kept.step_s / kept.size
    job = resolve(dataclasses.replace(picked, batch_size=pred.size, micro_batch_size=pred.size), 1)
    assert job.plan.checkpointing and job.plan.checkpoint_blocks == picked.checkpoint_blocks


def test_the_fit_over_lengths_is_the_trace_at_the_length():
    """--max-seq-len draws a profile at any length from three short traces: every count equals a trace at
    the length itself (attention's FLOPs and the trace's causal mask grow with its square)."""
    from bigfit.planning.longest import TRACED, _at_length
    from bigfit.planning.profile import profile_model

    cfg = llama(4)
    traced = [profile_model(cfg, 1, n, 0, "bf16", "cuda") for n in TRACED]
    fitted, direct = _at_length(traced, 3000), profile_model(cfg, 1, 3000, 0, "bf16", "cuda")
    for field in ("block_saved", "block_inputs", "other_saved", "loss_saved", "logits_numel", "tokens",
                  "block_traffic", "block_attention_flops", "flops_per_token", "block_ops"):
        assert getattr(fitted, field) == pytest.approx(getattr(direct, field), rel=1e-9), field


def test_plan_max_seq_len_finds_each_rows_longest(model_dirs, capsys):
    """`bigfit plan --max-seq-len`: each row's longest sequence fits and one token more does not (the
    machine with the allocator's share left, as the search rates it); a table and --json."""
    from bigfit.cli import main
    from bigfit.job.autoplan import planner_job
    from bigfit.models.source import load_config, locate
    from bigfit.planning.rows import roomy
    from bigfit.planning.search import plan_for_config
    from bigfit.settings.config import TrainConfig

    args = ["plan", "--model", str(model_dirs["llama"]), "--gpus", "1x2GB", "--cpu-ram", "64GB", "--max-seq-len"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "bigfit plan --max-seq-len" in out and "the longest sequence a sample" in out
    assert main([*args, "--json"]) == 0
    found = {r["name"]: r for r in json.loads(capsys.readouterr().out)["strategies"]}
    single = found["single"]
    assert single["max_seq_len"] > 1024 and single["row"]["fits"] and single["row"]["activations"] in (
        "keep", "checkpoint", "offload")
    config = load_config(locate(str(model_dirs["llama"])))
    hw = Hardware(gpu_bytes=(2 * GB,), cpu_ram=64 * GB)

    def fits(n):  # at n tokens, with the allocator's share of the GPU left
        job = planner_job(TrainConfig(model=str(model_dirs["llama"]), batch_size=1, max_source_len=n,
                                      precision="bf16"), config, 1)
        row = plan_for_config(config, hw, job, ("single",)).candidates[0]
        return row.fits and roomy(row.estimate, hw)

    assert fits(single["max_seq_len"]) and not fits(single["max_seq_len"] + 1)
    import bigfit

    data = bigfit.plan(model=str(model_dirs["llama"]), gpus="1x2GB", cpu_ram="64GB", max_seq_len=True)
    assert {r["name"]: r["max_seq_len"] for r in data["strategies"]}["single"] == single["max_seq_len"]


def test_plan_cp_fixes_the_context_parallel_degree(model_dirs, capsys):
    """`bigfit plan --cp 2`: the composed plans are those with cp 2, named like `dp_shard2 x cp2 (zero3)`."""
    from bigfit.cli import main

    assert main(["plan", "--model", str(model_dirs["llama"]), "--gpus", "4x80GB", "--cp", "2", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["composed"] and all(c["degrees"]["cp"] == 2 for c in p["composed"])
    assert "dp_shard2 x cp2 (zero3)" in {c["name"] for c in p["composed"]}


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    """Llama-3-8B's shape (config only)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama8b")
    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072).save_pretrained(path)
    return path


def test_llama_8b_at_64k_tokens_on_8_gpus_gets_a_plan_that_fits(llama8b, capsys):
    """The issue: every row needed 125-160 GB a GPU. With checkpointing chosen per row (the fewest
    blocks that fit) and the loss in chunks, a plan fits (node RAM given: rank 0 builds the fp32 model)."""
    from bigfit.cli import main

    assert main(["plan", "--model", str(llama8b), "--gpus", "8x80GB", "--batch-size", "8", "--seq-len", "65536",
                 "--cpu-ram", "1TB", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    by = {r["name"]: r for r in p["strategies"]}
    assert p["recommended"] and by[p["recommended"]]["fits"]
    assert by[p["recommended"]]["activations"] in ("checkpoint", "offload")
    assert by[p["recommended"]]["per_gpu_bytes"]["total"] < 0.95 * (80 * GB - 2**30)


def test_llama_8b_on_one_h100_holds_more_than_128k_tokens(llama8b):
    """The issue's target: the 8B full fine-tune (bf16) on one H100 with 125 GiB of RAM. The offload
    engine keeps bf16 parameters on the GPU and compact optimizer states in RAM; the activations are
    offloaded: the longest predicted is over 128K (141K on 2026-12-08; docs/planning.md)."""
    from bigfit.commands.plan import compute_longest, plan_settings

    cfg, machine, _ = plan_settings({"model": str(llama8b), "gpus": "1xH100", "cpu_ram": "125GiB",
                                     "max_seq_len": True})
    named, _, rated = compute_longest(cfg, machine)
    best = max(named, key=lambda r: r.tokens or 0)
    assert best.tokens > 128 * 1024 and best.name.startswith("zero2-offload")
    assert best.row.estimate.activations == "offload" and rated["micro_batch"] == 1

"""`bigfit plan`'s split rows: device_map (one process over a node's devices, planning/device_map_row.py) and
pipeline (one stage per process, planning/pipeline_row.py): their bytes against the balancer's map and the
pipeline's own cut, their step times, when they are candidates, and what `--strategy auto` launches
when it picks one. The data-parallel rows and accuracy are tests/test_planning.py."""
from __future__ import annotations

import pytest

from bigfit.errors import BigfitError
from bigfit.machine.hardware import Hardware

GB = 10**9

def llama_1b():
    from transformers import LlamaConfig

    # 1.1B parameters in 12 blocks (few blocks: a fast trace)
    return LlamaConfig(hidden_size=2560, intermediate_size=6912, num_hidden_layers=12, num_attention_heads=20,
                       num_key_value_heads=20, vocab_size=32000, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def mixed_plan():
    """A 1.1B Llama on a 24 GB and an 8 GB GPU: ZeRO-3's equal shards overflow the 8 GB card."""
    from bigfit.planning.search import Workload, plan_for_config

    from bigfit.planning.automap import profile_for

    hw = Hardware(gpu_bytes=(24 * GB, 8 * GB), cpu_ram=256 * GB)
    job = Workload(batch_size=8, seq_len=256)
    return hw, job, plan_for_config(llama_1b(), hw, job), profile_for(llama_1b(), job)  # one process: the whole batch


def test_device_map_bytes_per_device_follow_the_balancer(mixed_plan):
    from bigfit.planning.automap import plan_budgets, profile_costs
    from bigfit.planning.balance import balance, loads

    hw, job, p, prof = mixed_plan
    cost = profile_costs(prof, job)
    expected = balance(cost.blocks, plan_budgets(hw), main_bytes=cost.main, boundaries=cost.boundaries)
    assert p.device_map["assignment"] == expected == ["cuda:0"] * 9 + ["cuda:1"] * 3  # the larger GPU, more blocks
    want = loads(expected, cost.blocks, "cuda:0", cost.main)  # what the balancer fits: every kind at once
    devices = p.device_map["devices"]
    for d, v in devices.items():  # the peak moment: a block's gradients or its activations, not both
        mine = [part for part, dev in zip(cost.parts, expected) if dev == d]
        either = min(sum(b["grads"] for b in mine), sum(b["activations"] for b in mine))
        assert want[d] - either <= v["predicted_bytes"] < want[d] and v["predicted_bytes"] <= v["budget_bytes"]
    row = {c.estimate.name: c for c in p.candidates}["device_map"]
    shown = devices["cuda:0"]["predicted_bytes"]
    assert row.fits and row.estimate.per_gpu["total"] == shown == max(v["predicted_bytes"] for v in devices.values())
    on_0 = sum(prof.block_params[:9]) + prof.root_params  # its 9 blocks, embeddings and head
    assert row.estimate.per_gpu["params"] == 4 * on_0 and row.estimate.per_gpu["optimizer"] == 8 * on_0
    assert row.estimate.per_gpu["total"] > min(hw.gpu_bytes)  # more than the smallest GPU holds: not bounded by it


def test_auto_picks_device_map_when_only_offload_fits_otherwise(mixed_plan):
    hw, job, p, _ = mixed_plan
    by = {c.estimate.name: c for c in p.candidates}
    assert not any(by[s].fits for s in ("ddp", "zero1", "zero2", "zero3"))
    assert by["zero3"].estimate.per_gpu["total"] > min(hw.gpu_bytes) - 2**30  # equal shards: the 8 GB card overflows
    assert by["zero2-offload"].fits and by["zero3-offload"].fits
    assert p.recommended == "device_map"
    assert ("no data-parallel strategy fits without offload; the fastest data-parallel one that fits, zero2-offload, "
            f"takes {by['zero2-offload'].estimate.step_time_s:.3f} s") in p.reason
    dm = by["device_map"].estimate
    assert dm.bottleneck == "compute (1 of 2 devices idle)" and dm.costs["cpu_optimizer"] == 0  # no block on the host
    assert 0 < dm.costs["copies"] < dm.costs["compute"] / 100  # one hop there and one back, over NVLink


def test_device_map_devices_take_turns(mixed_plan):
    """The whole model's compute on one GPU at a time: twice ddp's over 2 GPUs where the host issues
    kernels in no time; each device no faster than the host issues its blocks otherwise."""
    from dataclasses import replace

    from bigfit.planning.hostcost import HOOK_S, pass_seconds
    from bigfit.planning.search import _parameter_traffic, plan

    hw, job, p, prof = mixed_plan
    free = {c.estimate.name: c.estimate for c in plan(prof, replace(hw, host_op_us=0.0), job, ("device_map", "ddp")).candidates}
    # ddp's work on the batch, without its once-a-step parameter traffic (the optimizer's, per GPU)
    work = free["ddp"].costs["compute"] - _parameter_traffic("ddp", prof, hw, job, 1)
    assert free["device_map"].costs["compute"] == pytest.approx(2 * work)
    dm = {c.estimate.name: c.estimate for c in p.candidates}["device_map"]
    issued = pass_seconds(prof, hw, job, range(9)) + pass_seconds(prof, hw, job, range(9, 12), outside=False)
    issued += 12 * HOOK_S  # the device map's hooks, one per block
    assert issued > free["device_map"].costs["compute"]  # 1.1B at 8 x 256 tokens: bound by the host
    assert dm.costs["compute"] == pytest.approx(issued)


def test_device_map_is_one_node(mixed_plan):
    from bigfit.planning.search import plan

    _, job, _, prof = mixed_plan
    two = plan(prof, Hardware(gpu_bytes=(24 * GB, 8 * GB), nodes=2, cpu_ram=256 * GB), job, ("device_map",))
    row = two.candidates[0]
    assert row.fits and row.why_not.startswith("one process on one node: the other 1 node(s) would sit idle")
    assert two.recommended is None and two.reason.startswith("nothing else fits (device_map one process on one node")


def test_device_map_loses_to_data_parallel_when_that_fits():
    from bigfit.planning.search import Workload, plan_for_config

    p = plan_for_config(llama_1b(), Hardware(gpu_bytes=(80 * GB, 80 * GB), cpu_ram=256 * GB), Workload(batch_size=8, seq_len=256))
    by = {c.estimate.name: c for c in p.candidates}
    dm = by["device_map"]
    assert dm.fits and dm.why_not is None and p.device_map["describe"].startswith("model 0-11 -> cuda:0")
    assert p.recommended in ("ddp", "zero2", "zero3")
    assert (f"device_map fits too but takes {dm.estimate.step_time_s:.3f} s/step, bound by compute (cuda:0; 1 GPU(s) "
            "unused), where data parallelism keeps every GPU busy at once") in p.reason


def test_device_map_step_time_sequential_or_gpipe():
    from bigfit.planning.device_map_row import _compute

    stages = {"cuda:0": 3.0, "cuda:1": 1.0}
    assert _compute(stages, 1) == 4.0  # one device at a time
    # GPipe: the slowest stage's 4 chunks, the other's one as the clock fills and drains
    assert _compute(stages, 4) == pytest.approx(3 * 0.75 + (0.75 + 0.25))
    even = {"cuda:0": 2.0, "cuda:1": 2.0}
    assert _compute(even, 4) == pytest.approx(2.0 * (4 + 2 - 1) / 4)  # balanced: N + p - 1 clocks


def test_the_hosts_blocks_are_host_work_beside_the_gpus_issuing(mixed_plan):
    """Blocks mapped to the host: their FLOPs at cpu_tflops plus a sweep of their weights every pass
    (micro-batch or chunk), and the one host also issues the GPU's kernels, so even with chunks the
    step is at least the two together."""
    from dataclasses import replace

    from bigfit.planning.device_map_row import HOST_SWEEP_S, map_costs

    hw, job, _, prof = mixed_plan
    cpu_blocks = list(range(8, 12))
    assignment = ["cuda:0"] * 8 + ["cpu"] * 4
    on_host = sum(prof.block_params[g] for g in cpu_blocks)
    costs, stage = {}, {}
    for chunks in (1, 2, 4):
        costs[chunks], stage[chunks] = map_costs(prof, hw, replace(job, chunks=chunks), assignment, "cuda:0")
    assert stage[2]["cpu"] - stage[1]["cpu"] == pytest.approx(on_host * HOST_SWEEP_S)  # one more pass, one more sweep
    assert stage[4]["cpu"] - stage[1]["cpu"] == pytest.approx(3 * on_host * HOST_SWEEP_S)
    for chunks in (2, 4):  # the host's chunks, then the GPU's issuing of them: never less than their sum
        assert costs[chunks]["compute"] >= stage[chunks]["cpu"] + stage[chunks]["cuda:0"] * 0.99
    assert costs[4]["compute"] > costs[2]["compute"] > costs[1]["compute"]  # chunks only cost here


def test_a_device_peaks_with_either_a_blocks_gradients_or_its_activations():
    """Gradients are made as backward frees each block's activations (device_map.auto._peak_moment)."""
    from bigfit.planning.automap import _peak_moment

    def blocks(g, a):
        return [{"grads": g, "activations": a}] * 3

    fixed = {"grads": 1, "activations": 2}  # outside the blocks: held throughout
    total = lambda bs: {k: fixed[k] + sum(b[k] for b in bs) for k in fixed}  # noqa: E731
    big_acts, big_grads = blocks(1, 4), blocks(4, 1)
    assert _peak_moment(big_acts, total(big_acts), 1) == (1, 2 + 12)  # when backward starts
    assert _peak_moment(big_grads, total(big_grads), 1) == (1 + 12, 2)  # the optimizer's step
    # 2 GPipe chunks: the first chunk through backward makes every gradient, frees half the activations
    assert _peak_moment(blocks(3, 4), total(blocks(3, 4)), 2) == (1 + 9, 2 + 6)


def test_strategy_auto_choosing_device_map_trains_with_the_auto_map(monkeypatch, tmp_path, capsys, pairs_file):
    """`bigfit train --strategy auto` given a device_map recommendation runs `--device-map auto`. The
    planner's answer is stubbed: on this CPU machine the map is one device, never recommended."""
    import bigfit.device_map.strategy as strategy
    import bigfit.job.autoplan as auto
    from bigfit.cli import main
    from conftest import read_jsonl

    asked, specs, read_spec = [], [], strategy.read_spec
    monkeypatch.setattr(strategy, "read_spec", lambda cfg: specs.append(cfg.device_map) or read_spec(cfg))

    def recommend(cfg, world, one_process=True, lengths=None):
        asked.append(one_process)
        if not one_process:
            raise BigfitError("stop: --nproc fixes the processes")
        return "device_map", {}, "stubbed"

    monkeypatch.setattr(auto, "auto_plan", recommend)
    common = ["--strategy", "auto", "--data", str(pairs_file), "--max-steps", "1", "--batch-size", "4", "--eval-samples",
              "0", "--save-every", "0", "--no-consolidate", "--output-dir", str(tmp_path)]
    assert main(["train", *common]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--strategy auto -> device_map: stubbed" in out and "device_map: 1 process" in out
    assert specs and set(specs) == {"auto"}  # the map balanced as the plan's was (checked, then applied)
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 1
    assert main(["train", *common, "--nproc", "2"]) == 2  # device_map is not offered to a fixed process count
    assert asked == [True, False]


def test_strategy_auto_plans_with_chunks_left_to_their_default(model_dirs):
    """A TrainConfig's chunks stay None until resolved; the plan behind --strategy auto takes that as
    each strategy's default (device_map's row once failed on it: auto without --nproc crashed)."""
    from bigfit.settings.config import TrainConfig
    from bigfit.job.autoplan import auto_strategy

    cfg = TrainConfig(model=str(model_dirs["llama"]), strategy="auto", batch_size=4, max_source_len=32)
    name, reason = auto_strategy(cfg, 2, one_process=True)
    assert cfg.chunks is None and "is the fastest that fits" in reason


def kept_parameters(config, layout, rank: int) -> tuple[int, list]:
    """What training's own split leaves a rank: its parameters after pipeline.split's cut and prune, on
    a meta model (tied ones once), and the cut."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from bigfit.layout.split import plan_split, prune

    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    split = plan_split(model, layout)
    prune(model, split, layout.stages_of(rank))
    return sum(p.numel() for p in model.parameters()), split.runs


def test_pipeline_row_holds_what_the_pipelines_own_cut_leaves_each_rank():
    """Each rank's states are those of the parameters training's cut and pruning leave it (T5's `shared`
    on both ranks: the encoder's first stage and the head's last); activations those of its blocks for
    the chunks 1F1B keeps in flight: every chunk on stage 0, one on the last, with the head and loss."""
    from bigfit.planning.automap import profile_for
    from bigfit.layout.cut import PipelineLayout
    from bigfit.planning.search import Workload, plan
    from tiny import tiny_config

    config = tiny_config("t5")  # 2 encoder and 3 heavier decoder blocks
    job = Workload(batch_size=8, seq_len=32, target_len=8, precision="bf16")
    prof = profile_for(config, job)  # one process's whole micro-batch: every stage reads the whole batch
    p = plan(prof, Hardware(gpu_bytes=(80 * GB,) * 2), job, ("ddp", "pipeline"))
    rows = {c.estimate.name: c for c in p.candidates}
    row = rows["pipeline"]
    assert set(row.to_json()) == set(rows["ddp"].to_json())  # every row has the same keys
    assert set(row.estimate.per_gpu) == set(rows["ddp"].estimate.per_gpu)
    assert row.fits and row.why_not is None and (p.pipeline["schedule"], p.pipeline["chunks"]) == ("1f1b", 2)
    layout = PipelineLayout(world=2, stages_per_rank=1, schedule="1f1b", chunks=2)
    kept = [kept_parameters(config, layout, r) for r in range(2)]
    runs = kept[0][1]
    assert [tuple(r) for r in p.pipeline["runs"]] == runs == [(0, 3), (3, 5)]  # the cut ends inside the decoder
    devices = {r: p.pipeline["devices"][f"rank {r}"]["parts"] for r in range(2)}
    for r, (n, _) in enumerate(kept):
        assert (devices[r]["params"], devices[r]["grads"], devices[r]["optimizer"]) == (4 * n, 4 * n, 8 * n)
    fullest = max(range(2), key=lambda r: p.pipeline["devices"][f"rank {r}"]["predicted_bytes"])
    assert row.estimate.per_gpu["params"] == 4 * kept[fullest][0]
    assert kept[0][0] + kept[1][0] == prof.params + config.vocab_size * config.d_model  # one tied copy more
    assert devices[0]["activations"] == sum(prof.block_saved[0:3])
    assert devices[1]["activations"] == (sum(prof.block_saved[3:5]) + prof.other_saved) // 2
    assert row.estimate.costs["tied all-reduce"] > 0
    assert row.estimate.labels["compute"] == "compute (pipeline bubble 33%)"  # 1 of 3 chunk-times idle


@pytest.fixture(scope="module")
def llama4():
    """A tiny Llama of 4 blocks (2 stages of 2, or 2 ranks x 2 interleaved stages) and its trace."""
    from bigfit.planning.automap import profile_for
    from bigfit.planning.search import Workload
    from tiny import tiny_config

    config = tiny_config("llama")
    config.num_hidden_layers = 4
    job = Workload(batch_size=8, seq_len=32)
    return config, job, profile_for(config, job)


def test_pipeline_bubble_gpipe_1f1b_and_interleaved(llama4, monkeypatch):
    """Over m chunks and p ranks the slowest rank works m + (p - 1) / v chunk-times: GPipe and 1F1B
    (v 1) leave (p - 1) / (m + p - 1) idle, interleaved v stages per rank divide that by v. 1F1B keeps
    p - s chunks in flight on stage s where GPipe keeps all m. Each stage action costs the host
    PIPELINE_ACTION_S, so interleaved, with v times the actions, issues longer."""
    from dataclasses import replace

    from bigfit.planning import pipeline_row as stages
    from bigfit.planning.pipeline_row import pipeline_row

    _, job, prof = llama4
    hw = Hardware(gpu_bytes=(80 * GB,) * 2)

    def rows_of(schedule):
        return pipeline_row(prof, hw, replace(job, chunks=4, pipeline_schedule=schedule))

    acting = {s: rows_of(s).estimate.costs["compute"] for s in ("1f1b", "interleaved")}
    monkeypatch.setattr(stages, "PIPELINE_ACTION_S", 0.0)
    rows = {s: rows_of(s) for s in ("gpipe", "1f1b", "interleaved")}
    # tiny blocks: the host's actions, twice as many interleaved, outweigh its shorter bubble
    assert acting["interleaved"] > acting["1f1b"] > rows["1f1b"].estimate.costs["compute"]
    gpipe, ofob, inter = (rows[s].estimate for s in ("gpipe", "1f1b", "interleaved"))
    # the label the bottleneck takes when compute dominates (tiny models spend longer on their optimizer step)
    assert (gpipe.labels["compute"], inter.labels["compute"]) == ("compute (pipeline bubble 20%)",
                                                                  "compute (pipeline bubble 11%)")
    # the same busy time per rank (uniform blocks; the head on rank 1 either way), stretched differently
    assert gpipe.costs["compute"] / (4 + 1) == pytest.approx(inter.costs["compute"] / (4 + 1 / 2))
    assert ofob.costs == gpipe.costs
    stage0 = sum(prof.block_saved[0:2])
    assert rows["gpipe"].section["devices"]["rank 0"]["parts"]["activations"] == stage0  # 4 chunks of 4
    assert rows["1f1b"].section["devices"]["rank 0"]["parts"]["activations"] == stage0 // 2  # 2 of 4
    assert [tuple(r) for r in rows["interleaved"].section["runs"]] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_interleaved_in_flight_follows_torchs_warmup():
    """The interleaved schedule's chunks in flight: torch's warmup forwards, then the steady phase's
    first forward before its first backward (torch.distributed.pipelining's own count)."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    from bigfit.layout.cut import PipelineLayout
    from bigfit.planning.pipeline_row import in_flight

    for w, v, m in [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 3, 8), (3, 2, 12)]:
        layout = PipelineLayout(world=w, stages_per_rank=v, schedule="interleaved", chunks=m)
        per_round = m // max(1, m // w)
        for rank in range(w):
            counts = in_flight(layout, rank)
            assert sum(counts) == min(_get_warmup_ops(rank, v, per_round, w, m) + 1, m * v)
            assert counts[0] >= counts[-1] and max(counts) <= m  # earlier stages run ahead
    assert in_flight(PipelineLayout(world=4, stages_per_rank=1, schedule="1f1b", chunks=8), 1) == [3]


def test_pipeline_is_a_candidate_on_several_gpus_of_one_node(llama4):
    from bigfit.planning.search import plan
    from bigfit.planning.pipeline_row import pipeline_row

    _, job, prof = llama4
    why = {name: pipeline_row(prof, hw, job).not_candidate for name, hw in {
        "one": Hardware(gpu_bytes=(80 * GB,)), "cpu": Hardware(gpu_bytes=(8 * GB,) * 2, device="cpu"),
        "nodes": Hardware(gpu_bytes=(80 * GB,) * 2, nodes=2), "two": Hardware(gpu_bytes=(80 * GB,) * 2)}.items()}
    assert why["one"].startswith("one GPU: a pipeline needs 2 or more")
    assert why["cpu"].startswith("a CPU-only machine") and why["nodes"].startswith("stages over 2 nodes")
    assert why["two"] is None
    deep = plan(prof, Hardware(gpu_bytes=(80 * GB,) * 8), job, ("pipeline",))  # 8 stages of 4 blocks
    row = deep.candidates[0]
    assert row.fits and "cuts the model into 8 stages" in row.why_not and "only 4 blocks" in row.why_not
    assert deep.pipeline["stages"] == 1 and deep.recommended is None  # shown as one stage


def test_auto_picks_pipeline_when_zero_waits_on_a_slow_link():
    """--strategy auto with fixed processes (no device_map): on PCIe-linked GPUs at a small batch the
    data-parallel rows wait on their gradients and gathers, a pipeline sends only activations; on
    NVLink at a larger batch ZeRO wins and the reason says what the pipeline's bubble costs."""
    from transformers import LlamaConfig

    from bigfit.settings.config import PIPELINE_STRATEGIES, STRATEGIES
    from bigfit.planning.search import Workload, plan_for_config

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False)
    strategies = STRATEGIES + PIPELINE_STRATEGIES
    slow = plan_for_config(config, Hardware(gpu_bytes=(24 * GB,) * 2, intra_gbps=16), Workload(batch_size=8, seq_len=256,
                           precision="fp32"), strategies)
    by = {c.estimate.name: c.estimate for c in slow.candidates}
    assert slow.recommended == "pipeline" and by["zero3"].bottleneck == "communication"
    assert slow.reason.startswith("pipeline is the fastest that fits: ") and "bound by compute (pipeline bubble 33%); " \
        f"the fastest data-parallel one that fits, ddp, takes {by['ddp'].step_time_s:.3f} s" in slow.reason
    fast = plan_for_config(config, Hardware(gpu_bytes=(80 * GB,) * 2), Workload(batch_size=64, seq_len=256, precision="fp32"),
                           strategies)
    pl = {c.estimate.name: c for c in fast.candidates}["pipeline"]
    assert fast.recommended != "pipeline" and pl.fits and not pl.why_not
    assert f"; pipeline fits too but takes {pl.estimate.step_time_s:.3f} s/step, bound by compute (pipeline bubble" \
        in fast.reason


def test_strategy_auto_choosing_pipeline_launches_its_resolved_layout(monkeypatch, tmp_path, pairs_file, model_dirs):
    """`bigfit train --strategy auto` given a pipeline recommendation hands the workers its settings
    with strategy pipeline: they resolve the schedule and chunks the plan rated (config.pipeline_defaults).
    The planner's answer is stubbed (this CPU machine never gets a pipeline), the launch captured."""
    import bigfit.commands.launch as launch
    import bigfit.job.autoplan as auto
    from bigfit.cli import main
    from bigfit.job.resolution import read
    from bigfit.planning.automap import profile_for
    from bigfit.planning.search import Workload
    from bigfit.planning.pipeline_row import pipeline_row
    from tiny import tiny_config

    launched = []
    monkeypatch.setattr(auto, "auto_plan", lambda cfg, world, one_process=True, lengths=None: ("pipeline", {"pp": 2}, "stubbed"))
    monkeypatch.setattr(launch, "launch_local", lambda argv, nproc, logs, **kw: launched.append((kw, nproc)) or 0)
    assert main(["train", "--strategy", "auto", "--nproc", "2", "--model", str(model_dirs["llama"]), "--data",
                 str(pairs_file), "--batch-size", "4", "--max-source-len", "32", "--output-dir", str(tmp_path)]) == 0
    (kw, nproc), = launched
    cfg = read(kw["job"]).cfg  # as each worker does: the launcher's job
    job = Workload(batch_size=4, seq_len=32, precision="fp32")
    planned = pipeline_row(profile_for(tiny_config("llama"), job), Hardware(gpu_bytes=(80 * GB,) * 2), job).section
    assert (cfg.strategy, nproc, cfg.pipeline_schedule, cfg.chunks) == ("pipeline", 2, planned["schedule"],
                                                                         planned["chunks"]) == ("pipeline", 2, "1f1b", 2)


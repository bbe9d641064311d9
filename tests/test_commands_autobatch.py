"""`--micro-batch-size auto` / `--batch-size auto`: the prediction's search over every size, the
probe's bisection, and probe workers that build the model once (one process) or start again only
after an out-of-memory error (several ranks), and that take a size that runs only by flushing the
allocator's cache for too full. OOMs and flushes are injected (common/faults.py: BIGFIT_FAULT=oom-above:N)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from bigfit.planning.sizes import Prediction, ProbeSearch, divisors, largest_true, outcome_text
from conftest import read_jsonl
from tiny import write_pairs


def _run(search: ProbeSearch, fits_up_to: int) -> ProbeSearch:
    while (m := search.next()) is not None:
        search.outcomes.append([m, m <= fits_up_to, None])
    return search


def test_probe_steps_away_from_the_prediction_then_bisects():
    assert outcome_text(_run(ProbeSearch(9, list(range(1, 4097))), 12).outcomes) == \
        "9 ok, 10 ok, 12 ok, 16 OOM, 14 OOM, 13 OOM"
    assert outcome_text(_run(ProbeSearch(16, divisors(16)), 4).outcomes) == "16 OOM, 8 OOM, 4 ok"
    # a prediction 1% too high (an H200's T5-large row): down by a tenth, then the gap bisected, not 0..343
    assert outcome_text(_run(ProbeSearch(343, list(range(1, 4097))), 340).outcomes) == \
        "343 OOM, 308 ok, 326 ok, 335 ok, 339 ok, 341 OOM, 340 ok"
    assert _run(ProbeSearch(7, list(range(1, 11))), 50).best() == 10  # everything runs: up to the cap
    assert _run(ProbeSearch(5, list(range(1, 11))), 0).best() is None  # not even 1


def test_a_size_that_runs_only_by_flushing_the_allocators_cache_counts_as_too_full():
    search = ProbeSearch(16, list(range(1, 33)))
    while (m := search.next()) is not None:  # out of memory above 20, the cache flushed above 12
        search.outcomes.append([m, m <= 12, m * 10**9 if m <= 20 else None])
    assert outcome_text(search.outcomes) == "16 full, 14 full, 10 ok, 12 ok, 13 full"
    assert search.best() == 12 and search.peak(12) == 12 * 10**9
    every = ProbeSearch(4, [1, 2, 3, 4], [[4, False, 9], [2, False, 5], [1, False, 3]])
    assert every.next() is None and every.best() == 1  # a slow run rather than none


@pytest.mark.parametrize("readings,flushes", [([0, 1, 1, 1], 0), ([0, 1, 1, 2], 1), ([0, 0], 0)])
def test_a_probe_step_that_flushed_is_judged_by_a_settled_step_at_its_size(monkeypatch, readings, flushes):
    """The blocks another size left cached can need one flush that a second step at this size does not."""
    import torch

    from bigfit.training import probe

    counts = iter(readings)  # the allocator's flush count before and after each step
    monkeypatch.setattr(probe, "train_step", lambda *a, **k: None)
    monkeypatch.setattr(probe, "_flushes", lambda devices: next(counts))
    job = SimpleNamespace(cfg=SimpleNamespace(batch_size=4, max_grad_norm=1.0), dataset=SimpleNamespace(pad_id=0),
                          seq2seq=False)
    rt = SimpleNamespace(data=SimpleNamespace(rank=0, world_size=1), rank=0, distributed=False, device=torch.device("cpu"))
    engine = SimpleNamespace(module=torch.nn.Linear(1, 1), flush=lambda: None)
    ran, _, found = probe._attempt(job, engine, rt, [{}] * 8, 4, steps=1)
    assert ran and found == flushes and next(counts, None) is None  # every reading taken, no more


@pytest.mark.parametrize("start", [1, 7, 64, 300, 4096])
def test_probe_finds_every_threshold_exactly_in_logarithmically_many_probes(start):
    sizes = list(range(1, 4097))
    for threshold in [1, 2, 3, 13, 63, 64, 65, 299, 1000, 4095, 4096]:
        search = _run(ProbeSearch(start, sizes), threshold)
        assert search.best() == threshold, (start, threshold, outcome_text(search.outcomes))
        # steps doubling away from the prediction up to the change, then a bisection of the gap
        assert len(search.outcomes) <= 2 * math.ceil(math.log2(4096)) + 2, outcome_text(search.outcomes)


def test_a_fixed_batch_probes_only_divisors():
    sizes = divisors(48)
    for threshold in range(1, 60):
        search = _run(ProbeSearch(48, sizes), threshold)
        assert all(48 % s == 0 for s, _, _ in search.outcomes)
        assert search.best() == max(s for s in sizes if s <= threshold)


def test_probe_keeps_to_sizes_the_data_fills():
    search = ProbeSearch(4096, list(range(1, 4097))).within(400)
    assert (search.start, search.sizes[-1]) == (400, 400)
    assert ProbeSearch(16, divisors(16)).within(10).start == 8


def test_largest_true_gallops_then_bisects():
    calls = []
    assert largest_true(lambda m: calls.append(m) or m <= 300, list(range(1, 4097))) == 300
    assert len(calls) <= 2 * math.ceil(math.log2(300)) + 1
    assert largest_true(lambda m: True, list(range(1, 4097))) == 4096
    assert largest_true(lambda m: False, [1, 2, 3]) is None


def test_the_prediction_searches_every_size_and_keeps_divisors_for_a_fixed_batch(monkeypatch, model_dirs):
    from bigfit.settings.config import TrainConfig
    from bigfit.job import autoplan as auto

    planned = []

    def plan(config, hw, job, strategies):  # the planner's bytes grow with the micro-batch; 300 still fits
        planned.append(job.micro_batch)
        est = SimpleNamespace(per_gpu={"total": job.micro_batch * 10**6}, step_time_s=0.1)
        return SimpleNamespace(candidates=[SimpleNamespace(fits=job.micro_batch <= 300, estimate=est)], device_map=None)

    monkeypatch.setattr(auto, "plan_for_config", plan)
    p = auto.auto_micro_batch(TrainConfig(model=str(model_dirs["gpt2"]), strategy="single", batch_size="auto"), 2)
    assert (p.size, p.need, p.sizes[-1]) == (300, 300 * 10**6, 4096)  # not a power of two
    assert len(set(planned)) <= 2 * math.ceil(math.log2(300)) + 1  # not 4096 plans
    p = auto.auto_micro_batch(TrainConfig(model=str(model_dirs["gpt2"]), strategy="single", batch_size=960), 2)
    assert (p.size, p.sizes) == (240, divisors(480))  # the largest divisor of the per-process 480 up to 300


def test_the_prediction_leaves_the_allocators_share_of_the_card(monkeypatch, model_dirs):
    """Filled to the plan's last byte a step runs only by flushing the allocator's cache: the predicted
    size is the largest that fits GPUs whose budgets leave CACHE_SLACK of each free (mixed sizes: each
    its own)."""
    from bigfit.settings.config import TrainConfig
    from bigfit.machine.hardware import Hardware
    from bigfit.job import autoplan as auto
    from bigfit.planning.estimate import CACHE_SLACK, RESERVE

    budget = 100 * 10**9
    monkeypatch.setattr(auto, "_this_machine", lambda *a, **k: Hardware(gpu_bytes=(2 * budget + RESERVE,
                                                                                      budget + RESERVE)))

    def plan(config, hw, job, strategies):  # 1 GB a sample on the smaller GPU: it holds 100 itself
        est = SimpleNamespace(per_gpu={"total": job.micro_batch * 10**9}, step_time_s=0.1)
        fits = est.per_gpu["total"] <= min(hw.gpu_bytes) - RESERVE
        return SimpleNamespace(candidates=[SimpleNamespace(fits=fits, estimate=est)], device_map=None)

    monkeypatch.setattr(auto, "plan_for_config", plan)
    p = auto.auto_micro_batch(TrainConfig(model=str(model_dirs["gpt2"]), strategy="single", batch_size="auto"), 2)
    assert CACHE_SLACK == 0.05 and (p.size, p.budget) == (95, budget)


def test_a_device_maps_prediction_keeps_on_the_gpu_the_blocks_the_smallest_size_keeps_there(monkeypatch, model_dirs):
    """device_map's balancer makes room for a larger micro-batch by moving blocks to the host, which
    computes them far slower: the predicted size is the largest whose map computes no more blocks on
    the host than the smallest size's, although larger sizes still fit (the real planner, tiny T5 on a
    GPU of 50 MiB past the reserve)."""
    from bigfit.settings.config import TrainConfig
    from bigfit.machine.hardware import Hardware
    from bigfit.models.source import load_config, locate
    from bigfit.job import autoplan as auto
    from bigfit.planning.estimate import CACHE_SLACK, RESERVE

    gpu = Hardware(gpu_bytes=(RESERVE + 50 * 2**20,), cpu_ram=8 * 2**30)
    monkeypatch.setattr(auto, "_this_machine", lambda *a, **k: gpu)
    # activations kept (--activations auto would weigh checkpointing against the host's blocks)
    cfg = TrainConfig(model=str(model_dirs["t5"]), strategy="device_map", batch_size="auto", precision="bf16",
                      activations="keep")
    p = auto.auto_micro_batch(cfg, 1)
    config = load_config(locate(cfg.model))
    slack = Hardware(gpu_bytes=(RESERVE + int((1 - CACHE_SLACK) * 50 * 2**20),), cpu_ram=8 * 2**30)

    def planned(m):
        plan = auto.plan_for_config(config, slack, auto._job(cfg, config, m, m), strategies=("device_map",))
        return plan.candidates[0].fits, auto._host_blocks(plan.device_map)

    assert p.size > 1 and planned(p.size) == (True, 0)
    fits, host = planned(p.size + 1)
    assert fits and host > 0  # fits, but only with blocks on the host
    assert planned(4 * p.size)[0]  # the largest that fits is far larger: not what auto picks


def test_no_probe_under_torchrun(monkeypatch, model_dirs, capsys):
    from bigfit.commands import autobatch
    from bigfit.settings.config import TrainConfig

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(autobatch, "launch_local", lambda *a, **k: pytest.fail("no probe under torchrun"))
    pred = autobatch.auto_micro_batch(TrainConfig(model=str(model_dirs["gpt2"]), strategy="single", batch_size=8), 1)
    cfg = TrainConfig(model=str(model_dirs["gpt2"]), strategy="single", batch_size=8, micro_batch_size="auto")
    chosen = autobatch.choose_micro_batch([], cfg, 1, speaks=True)
    assert (chosen.micro_batch_size, chosen.batch_size) == (pred.size, 8)
    assert f"micro-batch auto -> {pred.size}: predicted {pred.size} (" in capsys.readouterr().out


def test_a_probe_worker_killed_on_a_machine_without_gpus_counts_as_out_of_memory(monkeypatch, model_dirs, tmp_path,
                                                                                capsys):
    """The CPU's out of memory is the kernel's OOM killer (SIGKILL: commands/launch.py returns 128 + 9): the
    search takes it as a size that failed and goes on in new processes, as after a CUDA OOM."""
    from bigfit.commands import autobatch
    from bigfit.training import probefile
    from bigfit.settings.config import TrainConfig

    where = probefile.path(str(tmp_path))

    def workers(*args, **kwargs):  # each set builds once, runs sizes up to 9, and is killed above
        search = probefile.load(where)
        search.worker_sets += 1
        while (size := search.next()) is not None and size <= 9:
            search.outcomes.append([size, True, None])
        probefile.save(where, search)
        return 0 if size is None else autobatch.KILLED

    monkeypatch.setattr(autobatch, "launch_local", workers)
    monkeypatch.setattr(autobatch.torch.cuda, "is_available", lambda: False)
    cfg = TrainConfig(model=str(model_dirs["gpt2"]), strategy="single", batch_size="auto", output_dir=str(tmp_path))
    chosen = autobatch.choose_micro_batch([], cfg, 1, speaks=True, pred=Prediction(12, 1, 2, list(range(1, 13))))
    assert chosen.micro_batch_size == 9
    assert "probe micro-batch 12: out of memory on a rank; new probe processes go on" in capsys.readouterr().out


def test_a_card_another_process_holds_is_named_when_the_probe_cannot_build_the_model(monkeypatch, model_dirs, tmp_path):
    """Out of memory before the first probe step: the refusal carries CUDA's words on the card and on
    the processes holding it (a job left running there is the cause, not the model)."""
    from bigfit.commands import autobatch
    from bigfit.training import probefile
    from bigfit.settings.config import TrainConfig
    from bigfit.errors import BigfitError

    said = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
            "79.18 GiB of which 18.56 MiB is free. Process 1507 has 76.57 GiB memory in use. Including non-PyTorch "
            "memory, this process has 2.58 GiB memory in use.")

    def workers(argv, world, logs, **kwargs):  # the set fails while building: no probe step, no new set counted
        (logs / "error.txt").write_text(f"worker rank 0 failed: {said}\n")
        return probefile.OOM_EXIT

    monkeypatch.setattr(autobatch, "launch_local", workers)
    cfg = TrainConfig(model=str(model_dirs["gpt2"]), strategy="single", batch_size="auto", output_dir=str(tmp_path))
    with pytest.raises(BigfitError, match=r"building the model with single \(GPU 0 has a total capacity of 79.18 GiB "
                       r"of which 18.56 MiB is free. Process 1507 has 76.57 GiB memory in use.\); logs in "):
        autobatch.choose_micro_batch([], cfg, 1, speaks=True, pred=Prediction(12, 1, 2, list(range(1, 13))))


def _train(model_dir, data, out, *flags):
    from bigfit.cli import main

    return main(["train", "--model", str(model_dir), "--data", str(data), "--batch-size", "auto", "--max-steps", "1",
                 "--eval-samples", "0", "--save-every", "0", "--no-consolidate", "--output-dir", str(out), *flags])


def test_one_process_finds_the_threshold_with_one_model_build(model_dirs, pairs_file, tmp_path, capsys, monkeypatch):
    # out of memory as cuBLAS says it (a RuntimeError, not torch's OutOfMemoryError), recovered in place
    monkeypatch.setenv("BIGFIT_FAULT", "cublas-above:13")  # read by the probe processes, which inherit it
    code = _train(model_dirs["gpt2"], pairs_file, tmp_path, "--strategy", "single")
    printed = capsys.readouterr()
    assert code == 0, printed.err
    search = ProbeSearch.from_json(json.loads((tmp_path / "logs" / "probe" / "search.json").read_text()))
    assert search.best() == 13 and search.worker_sets == 1  # every OOM recovered in place: one build
    assert search.sizes[-1] == 400  # the 400 training samples bound the sizes, not the prediction
    assert len(search.outcomes) <= 2 * math.ceil(math.log2(400)), outcome_text(search.outcomes)
    out = " ".join(printed.out.split())
    assert f"probes {outcome_text(search.outcomes)}; confirmed 13 (peak" in out and "the model built once" in out
    assert "global 13 = 1 data-parallel x 1 accumulation x micro-batch 13" in out
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_two_ranks_start_new_probe_processes_only_after_an_oom(model_dirs, tmp_path, capsys, monkeypatch):
    # and agree on a size whose step flushed the allocator's cache on one of them (rank 1 above 10)
    monkeypatch.setenv("BIGFIT_FAULT", "oom-above:11,flush-above:10:1")
    data = write_pairs(tmp_path / "pairs.jsonl", n=24)  # 12 per rank: few sizes, few worker sets
    code = _train(model_dirs["gpt2"], data, tmp_path / "out", "--strategy", "ddp", "--nproc", "2")
    printed = capsys.readouterr()
    assert code == 0, printed.err
    search = ProbeSearch.from_json(json.loads((tmp_path / "out" / "logs" / "probe" / "search.json").read_text()))
    assert outcome_text(search.outcomes) == "12 OOM, 10 ok, 11 full"
    assert search.worker_sets == 2  # the OOM ended the first set; the second ran the rest in its processes
    assert "out of memory on a rank; new probe processes go on" in printed.out
    out = " ".join(printed.out.split())
    assert "probe micro-batch 11: ran (peak" in out and "but only by flushing the allocator's cache" in out
    assert "confirmed 10 (peak" in out and "the model built 2 times" in out
    assert len(read_jsonl(tmp_path / "out" / "metrics.jsonl")) == 1  # the job's own workers trained after


def test_a_probe_that_fails_otherwise_says_why(model_dirs, pairs_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BIGFIT_FAULT", "probe:0:0:raise")
    assert _train(model_dirs["gpt2"], pairs_file, tmp_path, "--strategy", "single") == 2
    err = capsys.readouterr().err
    assert "the micro-batch probe failed (worker rank 0 failed: RuntimeError: injected fault at probe 0 on rank 0" in err


def test_an_encoder_decoder_config_without_a_decoder_start_is_one_line(tmp_path, capsys):
    from transformers import T5Config

    from bigfit.cli import main

    T5Config(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=1, vocab_size=384).save_pretrained(tmp_path / "t5")
    assert main(["train", "--model", str(tmp_path / "t5"), "--output-dir", str(tmp_path / "out")]) == 2
    assert "its config.json has no decoder_start_token_id" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("delayed", [False, True], ids=["exact", "delayed"])
def test_the_offload_engine_probes_on_in_place_in_both_modes(model_dirs, tmp_path, capsys, monkeypatch, delayed):
    """The offload engine ends (or stops) the host step under way, frees the buckets a failed step
    claimed and probes on in its process, the model built once: also with --delayed-update, whose
    host step runs on under the next step (training/probe.py's two steps a size meet it)."""
    monkeypatch.setenv("BIGFIT_FAULT", "oom-above:10")  # 12 and 11 fail
    data = write_pairs(tmp_path / "pairs.jsonl", n=12)
    code = _train(model_dirs["gpt2"], data, tmp_path / "out", "--strategy", "zero2-offload", "--nproc", "1",
                  *["--delayed-update"] * delayed)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    search = ProbeSearch.from_json(json.loads((tmp_path / "out" / "logs" / "probe" / "search.json").read_text()))
    assert search.best() == 10
    failed = sum(1 for _, ran, _ in search.outcomes if not ran)
    assert failed >= 2 and search.worker_sets == 1 and "the model built once" in printed.out


def test_a_planned_device_map_is_balanced_once_for_the_prediction_and_the_job_runs_it(model_dirs, pairs_file,
                                                                                       tmp_path, capsys, monkeypatch):
    """The balancer moves blocks off the main device as the micro-batch grows: the probe and the job
    run the map balanced for the prediction (kept in logs/probe/device_map.json), never a map balanced
    for the probe's own settings (one sample: every block on the main device)."""
    from bigfit.settings.config import TrainConfig
    from bigfit.device_map.strategy import _resolve, _this_device
    from bigfit.models.source import load_config, locate, meta_model
    from bigfit.job.prepare import data_lengths

    budgets = tmp_path / "budgets.json"
    budgets.write_text(json.dumps({"auto": {"cpu": "8MB", "cpu:1": "100MB"}}))
    monkeypatch.setenv("BIGFIT_FAULT", "oom-above:6")
    code = _train(model_dirs["t5"], pairs_file, tmp_path / "out", "--strategy", "device_map", "--device-map", str(budgets))
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0, printed
    pinned = tmp_path / "out" / "logs" / "probe" / "device_map.json"
    predicted = int(printed.split("balanced for the predicted micro-batch ")[1].split(",")[0])
    assert f"kept in {pinned} for the probe and the job" in printed and "confirmed 6" in printed
    model = meta_model(load_config(locate(str(model_dirs["t5"]))))

    def balanced(micro: int) -> dict:  # for the data's longest samples, as the command plans
        cfg = TrainConfig(model=str(model_dirs["t5"]), data=str(pairs_file), strategy="device_map",
                          device_map=str(budgets), micro_batch_size=micro, batch_size=micro)
        return _resolve(model, cfg, _this_device(), data_lengths(cfg)).to_json()

    assert json.loads(pinned.read_text()) == balanced(predicted) != balanced(1)
    assert "encoder 0-1 -> cpu:1" in printed  # the job's description: the pinned map, blocks off the main device


def test_auto_with_auto_batch_sizes_picks_the_fastest_per_sample_at_each_strategys_largest_micro_batch(model_dirs):
    """--strategy auto --batch-size auto: each strategy runs at the largest micro-batch it holds, so
    auto rates each there, as --micro-batch-size auto then predicts it (its own search), and takes the
    least time a sample; with the batch given, the plan's pick at that batch stands."""
    import dataclasses

    from bigfit.settings.config import TrainConfig
    from bigfit.job import autoplan as auto

    cfg = TrainConfig(model=str(model_dirs["t5"]), strategy="auto", batch_size="auto", max_source_len=32,
                      max_target_len=16, max_train_samples=64, optimizer_states="fp32")
    name, reason = auto.auto_strategy(cfg, 2, one_process=False)
    assert "at the largest micro-batch each strategy is predicted to hold" in reason
    per_sample = {}
    for s in ("ddp", "zero1", "zero2", "zero3"):  # the candidates without GPUs (the offload rows: below)
        pred = auto.auto_micro_batch(dataclasses.replace(cfg, strategy=s), 2)
        assert pred.size <= 32  # bounded by each process's share of the samples
        per_sample[s] = pred.step_s / (2 * pred.size)
    assert per_sample[name] == pytest.approx(min(per_sample.values()), rel=1e-6)
    fixed = auto.auto_strategy(dataclasses.replace(cfg, batch_size=4), 2, one_process=False)
    assert fixed[1].startswith(f"{fixed[0]} is the fastest that fits")
    # without GPUs the offload rows run (and fit) but are no candidate: the host holds everything already
    offload = auto.plan_here(cfg, 2, ("zero2-offload", "zero3-offload")).candidates
    assert all(c.fits and c.why_not.startswith("not a candidate without GPUs") for c in offload)
    assert "offload" not in name and "offload" not in fixed[0]

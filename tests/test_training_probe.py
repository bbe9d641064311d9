"""micro-batch auto's probe under out-of-memory errors met anywhere in a step (forward, backward, the
offload engine's reduction, host step, copies and NVMe tier, zero3-offload's streamed step), injected
on the thread that runs each point (common/faults.py `at`), and under waits that never end: the size counts
as out of memory and the command trains at the largest that ran, or it ends in one line that says what
it waited for, by a deadline (BIGFIT_WAIT_S makes them short here).

The probes of one process run their worker in this process (`_in_process`: what `python -m bigfit`
runs, without the start of a process), several points to a run: each fails the first size above its
threshold that reaches it first; the hang and two ranks run as a user's command does."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from bigfit.common import faults
from bigfit.errors import BigfitError
from bigfit.planning.sizes import ProbeSearch, outcome_text
from bigfit.training import probefile
from conftest import read_jsonl
from tiny import Stack, write_pairs


def _train(model_dir, data, out, *flags):
    from bigfit.cli import main

    return main(["train", "--model", str(model_dir), "--data", str(data), "--batch-size", "auto", "--max-steps", "1",
                 "--eval-samples", "0", "--save-every", "0", "--no-consolidate", "--output-dir", str(out), *flags])


def _in_process(argv, world, logs, quiet=False, job=None, watch=None) -> int:
    """autobatch's launch_local for one process: the probe worker in this process, its exit status."""
    from bigfit.job.resolution import read
    from bigfit.training.loop import train

    try:
        train(read(job))
    except SystemExit as e:
        return e.code
    except Exception as e:
        (logs / "error.txt").write_text(f"worker rank 0 failed: {type(e).__name__}: {e}\n")
        return probefile.exit_status(e)
    return 0


def _search(out) -> ProbeSearch:
    return ProbeSearch.from_json(json.loads((out / "logs" / "probe" / "search.json").read_text()))


# (flags, faults, outcomes): 12 samples, so sizes 1-12 from 12; each point is the first its size meets
CASES = {
    "zero2-offload": (["--strategy", "zero2-offload"], "oom-at:forward:11,oom-at:reduce:9,oom-at:gather:7",
                      "12 OOM, 10 OOM, 6 ok, 8 OOM, 7 ok"),
    "zero2-offload-delayed": (["--strategy", "zero2-offload", "--delayed-update"],
                              "oom-at:backward:11,oom-at:hoststep:9:cublas,oom-at:upload:7:cuda",
                              "12 OOM, 10 OOM, 6 ok, 8 OOM, 7 ok"),
    "zero2-offload-nvme": (["--strategy", "zero2-offload-nvme", "--nvme-host-gb", "0", "--offload-grads", "device"],
                           "oom-at:fetch:11,oom-at:nvme-read:9,oom-at:nvme-write:7",
                           "12 OOM, 10 OOM, 6 ok, 8 OOM, 7 ok"),
    "zero3-offload": (["--strategy", "zero3-offload", "--max-grad-norm", "0"], "oom-at:forward:11,oom-at:streamed:9",
                      "12 OOM, 10 OOM, 6 ok, 8 ok, 9 ok"),
    "single": (["--strategy", "single"], "oom-at:backward:11:cublas,oom-at:forward:9",
               "12 OOM, 10 OOM, 6 ok, 8 ok, 9 ok"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_oom_at_any_point_of_a_probe_step_counts_as_out_of_memory(case, model_dirs, tmp_path, capsys,
                                                                      monkeypatch):
    from bigfit.commands import autobatch
    from bigfit.training import probewatch

    flags, fault, expected = CASES[case]
    monkeypatch.setenv("BIGFIT_FAULT", fault)
    monkeypatch.setattr(autobatch, "launch_local", _in_process)
    monkeypatch.setattr(probewatch, "exit_within", lambda *a, **k: None)  # this process goes on: the tests'
    data = write_pairs(tmp_path / "pairs.jsonl", n=12)
    code = _train(model_dirs["gpt2"], data, tmp_path / "out", "--nproc", "1", *flags)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    search = _search(tmp_path / "out")
    assert outcome_text(search.outcomes) == expected and search.worker_sets == 1  # recovered in place each time
    best = search.best()
    assert f"confirmed {best} (" in " ".join(printed.out.split()) and "the model built once" in printed.out
    assert len(read_jsonl(tmp_path / "out" / "metrics.jsonl")) == 1  # and trained at it


def test_two_ranks_count_an_oom_in_the_host_steps_copy_up(model_dirs, tmp_path, capsys, monkeypatch):
    """t5-3b's shape on a 24 GB cap: the OOM met by the host thread's copy up came to the training
    thread wrapped, and ended the command in a 40-line traceback. Two ranks: it ends the worker set."""
    monkeypatch.setenv("BIGFIT_FAULT", "oom-at:gather:3")
    data = write_pairs(tmp_path / "pairs.jsonl", n=8)  # 4 a rank
    code = _train(model_dirs["gpt2"], data, tmp_path / "out", "--strategy", "zero2-offload", "--nproc", "2")
    printed = capsys.readouterr()
    assert code == 0, printed.err
    search = _search(tmp_path / "out")
    assert outcome_text(search.outcomes) == "4 OOM, 3 ok" and search.worker_sets == 2
    assert "probe micro-batch 4: out of memory on a rank; new probe processes go on" in printed.out
    assert len(read_jsonl(tmp_path / "out" / "metrics.jsonl")) == 1


def test_a_probe_step_that_never_ends_ends_in_one_line_naming_what_it_waited_for(model_dirs, tmp_path, monkeypatch):
    """The host step waits for good at micro-batch 12: the probe's first step ends by its deadline
    (BIGFIT_WAIT_S), which says what the training thread waited for, in one line."""
    from conftest import bigfit, one_line

    monkeypatch.setenv("BIGFIT_WAIT_S", "4")  # bigfit() hands this process's environment on
    data = write_pairs(tmp_path / "pairs.jsonl", n=12)
    start = time.monotonic()
    done = bigfit("train", "--model", model_dirs["gpt2"], "--data", data, "--batch-size", "auto",
                  "--strategy", "zero2-offload", "--nproc", "1", "--max-steps", "1", "--eval-samples", "0",
                  "--output-dir", tmp_path / "out", fault="hang-at:hoststep:10")
    took = time.monotonic() - start
    said = one_line(done.stderr)
    assert done.returncode == 2 and said.startswith("error: the micro-batch probe at micro-batch 12: its step did "
                                                    "not end within 4 s (rank 0: the main thread, "), said
    assert "s for the host step's update of bucket 1 of 4 (it is at cpu-adam, bucket 1 of 4)" in said, said
    assert took < 60, took  # the deadline, not the step, ended it
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# -- the engine's recovery and the waits, in this process ------------------------------------------
def _offload(delayed: bool = False, eager: bool = False):
    from bigfit.common.distributed import Runtime
    from bigfit.offload.strategy import apply_offload

    torch.manual_seed(0)
    model = Stack(width=5)
    applied = apply_offload(model, "zero2-offload", Runtime(0, 1, 0, torch.device("cpu")), None, delayed=delayed,
                            eager=eager, nvme_dir=None)
    applied.attach_optimizer(torch.optim.AdamW, lr=0.0, fused=True)
    return model, applied


def _step(model, applied, x) -> None:
    model(x).pow(2).mean().backward()
    applied.update(0.0 if applied.engine.eager else 1.0, 1.0)


def _held_at(applied, bucket: int) -> tuple[threading.Event, threading.Event]:
    """(gate, entered): the host step stops before stepping `bucket` (then `entered` is set) until `gate` is."""
    gate, entered, adam = threading.Event(), threading.Event(), applied.engine._adam

    def held(b, grad):
        if b.index == bucket:
            entered.set()
            gate.wait()
        adam(b, grad)
    applied.engine._adam = held
    return gate, entered


@pytest.mark.parametrize("mode", ["exact", "delayed", "eager"])
def test_recovery_ends_the_host_step_under_way_before_it_drops_the_failed_steps_gradients(mode):
    """An OOM early in a forward (its first block) while the host step of the step before still
    stepped buckets: recovery cleared the gradients that thread had yet to read, and it waited for them
    for good, the next step for it, and the process's exit too (gpt-neo-1.3B's shape, 16 GB cap). In
    eager mode the thread waits for buckets a failed backward never sent: it is stopped."""
    model, applied = _offload(delayed=mode == "delayed", eager=mode == "eager")
    x = torch.randn(6, 5)
    _step(model, applied, x)
    applied.flush()
    gate, _ = _held_at(applied, 2)
    if mode == "eager":  # its host step starts with the first bucket backward sends down
        fail = model.layers[3].register_full_backward_pre_hook(lambda *_: _oom())
    else:
        _step(model, applied, x)  # its host step runs on, held at bucket 2
        fail = model.register_forward_pre_hook(lambda *_: _oom())
    with pytest.raises(torch.OutOfMemoryError):
        _step(model, applied, x)
    fail.remove()
    threading.Timer(0.2, gate.set).start()
    assert _within(20, applied.recover_from_oom, lambda: _step(model, applied, x), applied.flush), \
        "the step after the recovery never ended"


def test_a_recovery_that_cannot_end_the_host_step_says_where_it_is_within_its_deadline(monkeypatch):
    monkeypatch.setenv("BIGFIT_WAIT_S", "0.3")
    model, applied = _offload()
    gate, entered = _held_at(applied, 0)
    _step(model, applied, torch.randn(6, 5))
    assert entered.wait(10)  # its host step holds at bucket 0
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"host step did not end within 0.3 s: it is at cpu-adam, bucket 1 of 5"):
        applied.recover_from_oom()
    assert time.monotonic() - start < 5
    gate.set()
    applied.flush()


def test_the_interpreters_exit_waits_for_a_host_step_only_so_long(monkeypatch, capsys):
    from bigfit.offload.hoststep import join_at_exit

    monkeypatch.setenv("BIGFIT_WAIT_S", "0.2")
    model, applied = _offload()
    gate, entered = _held_at(applied, 0)
    _step(model, applied, torch.randn(6, 5))
    assert entered.wait(10)
    assert _within(10, lambda: join_at_exit(lambda: applied.engine))
    assert "exiting without the offload engine's host step, still at cpu-adam, bucket 1 of 5" in capsys.readouterr().out
    gate.set()
    applied.flush()


def _oom():
    raise torch.OutOfMemoryError("injected")


def _within(seconds: float, *calls) -> bool:
    """Whether `calls`, made in turn on a thread of their own, all returned within `seconds`."""
    done = threading.Event()

    def run():
        for call in calls:
            call()
        done.set()
    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)


# -- what counts, where faults fire, the launcher's own deadline ----------------------------------
def test_an_oom_an_engines_thread_hands_on_counts_as_out_of_memory_and_its_context_does_not():
    def wrapped(inner: BaseException) -> RuntimeError:
        try:
            raise RuntimeError("the offload engine's host step failed") from inner
        except RuntimeError as e:
            return e

    assert probefile.out_of_memory(wrapped(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 258 MiB")))
    assert probefile.out_of_memory(wrapped(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED")))
    assert probefile.exit_status(wrapped(torch.OutOfMemoryError("x"))) == probefile.OOM_EXIT
    assert not probefile.out_of_memory(wrapped(ValueError("x")))
    try:
        try:
            raise torch.OutOfMemoryError("x")
        except torch.OutOfMemoryError:
            raise KeyError("raised while handling it")  # noqa: B904 (its context, not its cause)
    except KeyError as e:
        assert not probefile.out_of_memory(e) and probefile.exit_status(e) == 1
    # a worker's user mistake (a full disk on rank 1, say) ends the launch with 2, as one process does
    assert probefile.exit_status(BigfitError("no room")) == 2


def test_a_fault_point_fires_inside_a_probe_step_above_its_size_only(monkeypatch):
    monkeypatch.setenv("BIGFIT_FAULT", "oom-at:gather:4,oom-at:reduce:2:cublas,oom-at:fetch:2:cuda")
    faults.at("gather")  # no probe step under way
    with faults.probing(4):
        faults.at("gather")  # not above 4
        faults.at("hoststep")  # not named
    with faults.probing(5):
        with pytest.raises(torch.OutOfMemoryError, match=r"injected at gather: micro-batch 5"):
            faults.at("gather")
        with pytest.raises(RuntimeError, match="CUBLAS_STATUS_ALLOC_FAILED") as cublas:
            faults.at("reduce")
        with pytest.raises(RuntimeError, match="^CUDA error: out of memory") as cuda:
            faults.at("fetch")
    assert all(probefile.out_of_memory(e.value) for e in (cublas, cuda))
    assert set(faults.POINTS) == {"forward", "backward", "reduce", "hoststep", "fetch", "gather", "upload",
                                  "nvme-read", "nvme-write", "streamed"}


def test_the_launcher_stops_workers_that_overstay_their_deadline_and_says_so(tmp_path):
    from bigfit.commands import launch

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    asked = []
    code = launch._wait_all({0: proc}, tmp_path, tmp_path, quiet=True,
                            watch=lambda: "overstayed" if asked.append(1) or len(asked) > 2 else None)
    assert code == launch.STOPPED and proc.poll() is not None
    assert (tmp_path / "error.txt").read_text() == "overstayed\n"


def test_a_worker_set_past_its_promise_and_the_grace_is_overstayed(tmp_path, monkeypatch):
    from bigfit.commands import autobatch

    where = probefile.path(str(tmp_path))
    where.parent.mkdir(parents=True)
    assert autobatch._overstayed(where) is None  # building the model: no promise yet
    monkeypatch.setenv("BIGFIT_WAIT_S", "1")
    probefile.promise(where, 60)
    assert autobatch._overstayed(where) is None
    probefile.promise(where, -2)
    assert "passed the deadline they had set themselves by 1 s" in autobatch._overstayed(where)


def test_a_workers_deadlines_end_it_with_the_status_the_launcher_reads_and_say_what_it_waited_for(tmp_path,
                                                                                               monkeypatch):
    from bigfit.common import waits
    from bigfit.training import probewatch

    ended = []
    monkeypatch.setattr(probewatch.os, "_exit", ended.append)
    where = probefile.path(str(tmp_path))
    where.parent.mkdir(parents=True)
    with waits.waiting("bucket 3's gradients"):
        probewatch.stuck(where, 12, 4, True, 0)  # after an OOM in this process: new ones try again
        probewatch.stuck(where, 12, 4, False, 1)  # in fresh ones: nothing to try again
    note = probefile.take_note(where)
    assert ended == [probefile.RETRY_EXIT, probefile.STUCK_EXIT] and note.startswith(
        "its step did not end within 4 s after an out-of-memory error in the same processes (rank 0: the main "
        "thread, 0 s for bucket 3's gradients)")  # the first rank's note is kept
    monkeypatch.setenv("BIGFIT_WAIT_S", "0.1")
    gone = threading.Event()
    monkeypatch.setattr(probewatch.os, "_exit", lambda code: (ended.append(code), gone.set()))
    probewatch.exit_within(where, probefile.OOM_EXIT, "an error ended their search")
    assert gone.wait(10) and ended[-1] == probefile.OOM_EXIT
    assert probefile.take_note(where).startswith("its processes had not exited 0.1 s after an error ended their search")


def test_each_end_of_a_worker_set_goes_on_or_is_one_line(tmp_path, capsys):
    from bigfit.commands import autobatch
    from bigfit.settings.config import TrainConfig
    from bigfit.errors import BigfitError
    from bigfit.commands.launch import STOPPED

    where = probefile.path(str(tmp_path))
    where.parent.mkdir(parents=True)
    cfg = TrainConfig(strategy="zero2-offload", output_dir=str(tmp_path))
    over = ProbeSearch(4, [1, 2, 3, 4], [[4, True, None]], 1)
    (where.parent / "error.txt").write_text("its processes passed the deadline they had set themselves\n")
    assert autobatch._after(STOPPED, over, 1, 0, cfg, where) is over  # the search was over: the job goes on
    assert "probe: its processes passed the deadline they had set themselves; the search was over: the job goes on" \
        in capsys.readouterr().out
    going = ProbeSearch(4, [1, 2, 3, 4], [[4, False, None]], 1)
    autobatch._after(STOPPED, going, 1, 0, cfg, where)  # an OOM in those processes: new ones try 3
    assert "probe micro-batch 3: in new probe processes (its processes passed the deadline" in capsys.readouterr().out
    probefile.note(where, "its step did not end within 4 s (rank 0: the main thread, 4 s for X)")
    with pytest.raises(BigfitError, match=r"^the micro-batch probe at micro-batch 3: its step did not end within 4 s "
                                          r"\(rank 0: the main thread, 4 s for X\); logs in "):
        autobatch._after(probefile.STUCK_EXIT, going, 1, 1, cfg, where)
    (where.parent / "error.txt").write_text("worker rank 0 failed: KeyError: 'x'\nTraceback (most recent call last):\n")
    with pytest.raises(BigfitError, match=r"^the micro-batch probe failed \(worker rank 0 failed: KeyError: 'x'\); "
                                          r"logs in [^\n]*$"):
        autobatch._after(1, going, 1, 1, cfg, where)

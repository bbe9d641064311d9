"""`--micro-batch-size auto` / `--batch-size auto`: the largest micro-batch the planner predicts to
fit (job/autoplan.py), then the largest that runs, found by probe workers (training/probe.py).

The probe starts at the prediction, steps away from it (up while sizes run, down while they fail)
and bisects between the largest that ran and the smallest that failed (planning/sizes.py). Its
workers build the model once and try the sizes one after another; one process recovers from an
out-of-memory error in place, while with several ranks an OOM ends the worker set (OOM_EXIT) and
this launcher starts another from the outcomes recorded so far (training/probefile.py). The probe's
processes exit before the real job starts, so its OOMs never reach the job's process group.
Every wait is bounded: the workers end a step, their recovery and their exit by deadlines of their
own (training/probewatch.py), and this launcher stops a set that overstays them. The search ends in
a confirmed size or in one line."""
from __future__ import annotations

import dataclasses
import functools
import re
import signal
import time
from pathlib import Path

import torch

from ..common import waits
from ..common.distributed import launched_by_torchrun_env
from .launch import STOPPED, launch_local
from ..errors import BigfitError
from ..job.autoplan import auto_micro_batch
from ..job.resolution import DataRef, resolve, write
from ..planning.estimate import CACHE_SLACK
from ..planning.sizes import Prediction, ProbeSearch, outcome_text
from ..settings.config import SPLIT_STRATEGIES, TrainConfig
from ..training import probefile
from ..training.probefile import OOM_EXIT, RETRY_EXIT, STUCK_EXIT, load, path, save

# a worker killed by SIGKILL (commands/launch.py: 128 + 9): on a machine without GPUs, where the micro-batch
# fills host RAM, that is the kernel's OOM killer, not a CUDA out-of-memory error
KILLED = 128 + signal.SIGKILL
# how long past the deadline its workers set themselves (training/probewatch.py) a worker set may run
# before this launcher stops it: their own deadline ends them first, unless nothing in them can run
GRACE_S = 30.0


def exit_status(e: BaseException) -> int:
    """A failed worker's exit status: 2 for a user's mistake, OOM_EXIT for out-of-memory (itself or as a
    cause), 1 otherwise (training/probefile.py)."""
    return probefile.exit_status(e)


def choose_micro_batch(argv: list[str], cfg: TrainConfig, world: int, speaks: bool,
                       pred: Prediction | None = None, lengths: tuple[int, int] | None = None,
                       data: DataRef | None = None) -> TrainConfig:
    """cfg with its micro-batch and global batch decided: the prediction (`pred`, else made here)
    confirmed and pushed as far as probes allow; under torchrun, whose processes are the job's, the
    prediction alone. A device map balanced by the planner is balanced once, for the prediction
    (OUTPUT/logs/probe/device_map.json): the probe confirms sizes for the map the job then runs.
    `lengths`: the data's longest sample, as the planner rates it; `data`: the tokenized data the
    probe's workers map (job/prepare.py handed_over)."""
    pred = pred or auto_micro_batch(cfg, world, lengths)
    cfg = _pinned_map(cfg, pred.size, speaks, lengths)
    said = (f"predicted {pred.size} ({_gb(pred.need)} of {_gb(pred.budget)}, {CACHE_SLACK:.0%} of it left to the "
            f"allocator's cache)")
    if launched_by_torchrun_env():
        if speaks:
            print(f"micro-batch auto -> {pred.size}: {said}; not probed under torchrun (its processes are the job's)")
        return _decided(cfg, world, pred.size)
    start = time.perf_counter()
    search = _probe(argv, cfg, world, pred, data)
    took = time.perf_counter() - start
    best = search.best()
    if search.start < pred.size:  # the workers keep to sizes the longest samples can fill
        said += f", the data gives {search.sizes[-1]} samples per process at most"
    if best is None:
        raise BigfitError(f"--micro-batch-size auto: {said}, but even micro-batch {search.sizes[0]} ran out of "
                          f"memory in the probe ({outcome_text(search.outcomes)})")
    peak = search.peak(best)
    measured = f"peak {_gb(peak)} measured, {_gb(pred.budget - peak)} left" if peak else "measured by a probe step"
    builds = (f"probed in {took:.0f} s, the model built once" if search.worker_sets == 1 else f"probed in {took:.0f} s, "
              f"the model built {search.worker_sets} times: new probe processes after an OOM on several ranks "
              "or where the engine cannot go on after one")
    print(f"micro-batch auto -> {best}: {said}, probes {outcome_text(search.outcomes)}; confirmed {best} "
          f"({measured}; {builds})")
    return _decided(cfg, world, best)


def _pinned_map(cfg: TrainConfig, micro: int, speaks: bool, lengths: tuple[int, int] | None) -> TrainConfig:
    if cfg.strategy not in SPLIT_STRATEGIES:
        return cfg
    from ..device_map.strategy import pin_auto_map  # here: a launcher imports this module, not the training stack

    pinned = pin_auto_map(cfg, micro, path(cfg.output_dir).parent / "device_map.json", lengths)
    if pinned is None:  # the user's map
        return cfg
    if speaks:
        print(f"--device-map auto: balanced for the predicted micro-batch {micro}, kept in {pinned} for the probe "
              "and the job")
    return dataclasses.replace(cfg, device_map=pinned)


def _decided(cfg: TrainConfig, world: int, micro: int) -> TrainConfig:
    return dataclasses.replace(cfg, micro_batch_size=micro, batch_size=_batch(cfg, world, micro))


def _probe(argv: list[str], cfg: TrainConfig, world: int, pred: Prediction, data: DataRef | None) -> ProbeSearch:
    """Probe worker sets until the search is over; each runs sizes until it ends or one of its
    ranks runs out of memory (then that size, the search's next, failed), or a deadline passes."""
    where = path(cfg.output_dir)
    search = ProbeSearch(pred.size, pred.sizes)
    save(where, search)
    # the workers read their sizes from the search; these only need to pass the checks (whole
    # accumulation steps, a global batch the data fills)
    low = pred.sizes[0]
    settings = dataclasses.replace(cfg, micro_batch_size=low, batch_size=_batch(cfg, world, low), probe_only=True)
    job = write(resolve(settings, world).with_data(data or DataRef()), where.parent / "job.json")
    while search.next() is not None:
        probefile.promise(where, None)  # the workers promise again once they have built the model
        probefile.take_note(where)
        code = launch_local(argv, world, where.parent, quiet=True, job=job,
                            watch=functools.partial(_overstayed, where))
        if code == KILLED and not torch.cuda.is_available():  # the kernel's OOM killer: the CPU's "out of memory"
            code = OOM_EXIT
        seen, sets, search = len(search.outcomes), search.worker_sets, load(where)
        _show(search.outcomes[seen:])
        search = _after(code, search, sets, seen, cfg, where)
    return search


def _after(code: int, search: ProbeSearch, sets: int, seen: int, cfg: TrainConfig, where: Path) -> ProbeSearch:
    """The search after a worker set ended with `code`: an outcome added for a size that failed, or
    one line where the probe cannot go on."""
    note, logs = probefile.take_note(where), where.parent
    if code == STOPPED:  # this launcher's deadline: the workers overstayed their own; as theirs would have ended them
        oom = any(not ok and not peak for _, ok, peak in search.outcomes[seen:])  # in the same processes
        note, code = _first_line(logs), RETRY_EXIT if oom else STUCK_EXIT
    if search.next() is None:  # whatever kept the processes: the search was over
        if note or code != 0:
            print(f"probe: {note or f'its processes ended with status {code}'}; the search was over: the job goes on")
        return search
    if code == OOM_EXIT and search.worker_sets == sets:  # it never reached a probe step
        raise BigfitError(f"the micro-batch probe ran out of memory before its first step, building the model "
                          f"with {cfg.strategy}{_device_words(logs)}; logs in {logs}")
    if code == OOM_EXIT:
        failed = search.next()
        search.outcomes.append([failed, False, None])
        save(where, search)
        print(f"probe micro-batch {failed}: out of memory on a rank"
              + ("; new probe processes go on" if search.next() is not None else ""))
    elif code == RETRY_EXIT:  # a fresh set's first step never ends it so: this cannot repeat forever
        print(f"probe micro-batch {search.next()}: in new probe processes "
              f"({note or 'the last ones could not go on after an out-of-memory error'})")
    elif code == STUCK_EXIT:
        raise BigfitError(f"the micro-batch probe at micro-batch {search.next()}: "
                          f"{note or 'its step did not end by its deadline'}; logs in {logs}")
    elif code != 0:
        why = _first_line(logs) or f"exit status {code}"
        raise BigfitError(f"the micro-batch probe failed ({why}); logs in {logs}")
    return search


def _overstayed(where: Path) -> str | None:
    """Why a worker set is stopped: it passed the time rank 0 promised by GRACE_S (None: not yet)."""
    until, grace = probefile.promised(where), waits.limit(GRACE_S)
    if until is None or time.time() < until + grace:
        return None
    return (f"its processes passed the deadline they had set themselves by {grace:g} s without ending (logs "
            f"in {where.parent}), and were stopped")


def _first_line(logs: Path) -> str:
    """The first line of a worker set's report (its traceback stays in the file: one line here)."""
    report = logs / "error.txt"
    lines = report.read_text().strip().splitlines() if report.is_file() else []
    return lines[0] if lines else ""


def _device_words(logs: Path) -> str:
    """What CUDA said of the card when a worker ran out of memory, with the other processes that hold it
    (a job left running on the card, not the model, is then the cause): " (GPU 0 has ... in use.)"."""
    report = logs / "error.txt"
    found = re.search(r"GPU \d+ has a total capacity of .*? is free\.(?: Process \d+ has \S+ \S+ memory in use\.)*",
                      report.read_text() if report.is_file() else "")
    return f" ({found.group(0)})" if found else ""


def _show(outcomes: list[list]) -> None:
    for size, ran, peak in outcomes:
        if ran:
            said = f"ran (peak {_gb(peak)})" if peak else "ran"
        elif peak:  # it ran, but only by flushing the allocator's cache (planning/sizes.py ProbeSearch)
            said = f"ran (peak {_gb(peak)}), but only by flushing the allocator's cache: too full to run at speed"
        else:
            said = "out of memory"
        print(f"probe micro-batch {size}: {said}")


def _batch(cfg: TrainConfig, world: int, micro: int) -> int:
    """--batch-size auto: one micro-batch per process, no accumulation; else the batch given."""
    return micro * world if cfg.batch_size == "auto" else cfg.batch_size


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"

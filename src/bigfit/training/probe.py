"""micro-batch auto's probe worker: the model and engine are built once (loop.py) and candidate
micro-batches are tried in sequence in the same processes, each with one full step (forward,
backward, the optimizer step) on this rank's share of the longest samples at lr 0; two where the
optimizer's update runs on under the next forward (the offload engine's host step: the two overlap
in training), and the update landed before the size counts as run.

One process catches an out-of-memory error wherever the step met it (an engine's thread hands its
own on, probefile.py `out_of_memory`), frees what the failed step held and goes on. With several
ranks the others are inside a collective of the failed step, so the error ends the worker set
(OOM_EXIT) and the launcher starts another from the outcomes agreed so far (probefile.py). Every
step, recovery and exit has a deadline (probewatch.py). Nothing of a probe reaches the real job:
its processes exit before the job starts."""
from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..common import faults, waits
from ..common.distributed import Runtime, all_reduce_sum, barrier
from ..data.arrays import longest_first
from ..engine import Engine
from ..job.prepare import Prepared
from ..models.source import block_lists
from ..planning.sizes import ProbeSearch, outcome_text
from . import probefile
from . import probewatch
from .metrics import allocator_flushes
from .probewatch import deadline as _deadline
from .step import train_step


def probe(job: Prepared, engine: Engine, rt: Runtime) -> dict:
    """Run the search in probefile.path(OUTPUT) until it is over; returns its outcomes. However it
    ends, the process then exits within probewatch.EXIT_S."""
    where = probefile.path(job.cfg.output_dir)
    search = probefile.load(where).within(len(job.dataset.train) // rt.data.world_size)
    search.worker_sets += 1
    _agreed_save(where, search, rt)
    faults.maybe_die("probe", 0, rt)  # BIGFIT_FAULT=probe:0:0:raise: a probe that fails, not by OOM
    try:
        _search(job, engine, rt, where, search)
    except SystemExit as e:
        probewatch.exit_within(where, e.code, "they gave up on a size")
        raise
    except BaseException as e:
        probewatch.exit_within(where, probefile.exit_status(e), f"{type(e).__name__} ended their search", e)
        raise
    if rt.is_main:
        probefile.promise(where, waits.limit(probewatch.EXIT_S))
    probewatch.exit_within(where, 0, "their search ended")
    return {"probes": search.outcomes}


def _search(job: Prepared, engine: Engine, rt: Runtime, where: Path, search: ProbeSearch) -> None:
    longest = longest_first(job.dataset.train)
    clock, stepped = probewatch.StepClock(), False
    while (micro := search.next()) is not None:
        t0, seconds = time.perf_counter(), clock.deadline()
        if rt.is_main:
            probefile.promise(where, seconds)
        expire = functools.partial(probewatch.stuck, where, micro, seconds, clock.failed, rt.rank)
        with _deadline(seconds, expire):
            # two steps: the optimizer states do not exist during a process's first backward (the second
            # meets them, as every training step does), and an update that runs on meets the next forward
            ran, peak, full = _attempt(job, engine, rt, longest, micro,
                                       steps=2 if not stepped or engine.updates_in_background else 1)
            went_on = ran or _recovered(engine, micro, where)
        clock.slowest, clock.failed = max(clock.slowest, time.perf_counter() - t0), clock.failed or not ran
        stepped = ran  # a recovered engine dropped its optimizer states: the next size steps twice again
        if full:
            _free(engine)  # the next size starts from an empty cache
        search.outcomes.append([micro, ran and not full, _largest(peak, rt) if ran else None])
        _agreed_save(where, search, rt)
        if rt.is_main:
            print(f"probe micro-batch {micro}: {outcome_text(search.outcomes[-1:])} in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        if not went_on and search.next() is not None:
            raise SystemExit(probefile.RETRY_EXIT)  # the next size in new processes, at once


def _recovered(engine: Engine, micro: int, where: Path) -> bool:
    """Whether the engine could drop the failed step and go on in this process."""
    if not engine.recovers_from_oom:
        return False
    try:
        engine.recover_from_oom()
    except RuntimeError as e:  # it could not end the failed step (the error says what it waited for)
        print(f"probe micro-batch {micro}: {e}", flush=True)
        probefile.note(where, f"the last ones could not recover in place from an out-of-memory error: {e}")
        return False
    return True


def _attempt(job: Prepared, engine: Engine, rt: Runtime, longest: Sequence[dict], micro: int,
             steps: int) -> tuple[bool, int | None, bool]:
    """(ran, peak bytes, whether it ran only by flushing the allocator's cache on some rank: every rank
    takes the same next size) of `steps` steps at `micro` and their update landed (a third where a
    single step flushed: the blocks another size left cached are not this size's). A fixed batch that
    accumulates runs two micro-batches, the second's backward beside the first's gradients, as in
    training."""
    data, cfg = rt.data, job.cfg
    mine = longest[data.rank * micro:(data.rank + 1) * micro]
    accumulated = [mine] * min(2, max(1, cfg.batch_size // data.world_size // micro))
    hooks = [faults.inject_oom(engine.module, micro),
             *faults.inject_points(engine.module, [b for _, blocks in block_lists(engine.module) for b in blocks])]
    devices = _devices(engine, rt)
    _reset_peak(devices)
    full = False

    def step() -> int:  # the allocator's cache flushes in one step
        before = _flushes(devices)
        # no loss scaler: an fp16 overflow at the initial scale would skip the step, and with it the
        # allocation of the optimizer states; the scale itself costs no memory
        train_step(engine, accumulated, pad_id=job.dataset.pad_id, seq2seq=job.seq2seq, rt=rt, lr=0.0,
                   max_grad_norm=cfg.max_grad_norm, scaler=None)
        return _flushes(devices) - before + faults.injected_flushes(micro, rt.rank)

    try:
        with faults.probing(micro):
            for _ in range(steps):
                flushes = step()
            engine.flush()  # the update lands inside this size's step: an OOM in its host step or copies is this size's
        full = _any(flushes, rt)
        if full and steps == 1:  # the blocks another size left cached may need one flush: a settled step
            with faults.probing(micro):
                flushes = step()
                engine.flush()
            full = _any(flushes, rt)
        ran = True
    except RuntimeError as e:  # torch's OutOfMemoryError is one
        # several ranks: the others wait inside this step's collectives, so this worker set ends (commands/autobatch.py)
        if rt.distributed or not probefile.out_of_memory(e):
            raise
        ran = False  # leaving the except drops the error and its frames, which held the step's activations
    finally:
        for hook in hooks:
            if hook is not None:
                hook.remove()
    if not ran:
        _free(engine)
    return ran, _peak(devices), full


def _any(flushes: int, rt: Runtime) -> bool:
    """Whether any rank's allocator flushed (collective: every rank decides alike)."""
    return all_reduce_sum([float(flushes)], rt)[0] > 0


def _flushes(devices: list) -> int:
    """How often the allocator has flushed its cache so far: a cudaMalloc failed, every cached block was
    freed (synchronizing the device) and the allocation retried. A size that needs that in a steady step
    runs, but slowly: T5-large under zero2-offload on an H100 took 1.06-1.31 s a step at micro-batch 192
    (peak 82.3 GB) against 0.53 s at 160 (2026-12-06). DeepSpeed warns of the same count in training."""
    return sum(allocator_flushes(d) for d in devices)


def _free(engine: Engine) -> None:
    """What a failed step may still hold: gradients, FSDP2's gathered parameters, cycles through the
    autograd graph, and the allocator's cached blocks (so the next size finds them free)."""
    for p in engine.model.parameters():
        p.grad = None
    engine.reshard()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _devices(engine: Engine, rt: Runtime) -> list[torch.device]:
    """The GPUs this process computes on (device_map's one process: several); none on a CPU."""
    found = {p.device for p in engine.module.parameters() if p.device.type == "cuda"} | {rt.device}
    return sorted((d for d in found if d.type == "cuda"), key=str)


def _reset_peak(devices: list) -> None:
    """Start measuring a peak: on GPUs the allocator's, on the CPU the process's peak RSS (Linux;
    calibrate.py measures the same way)."""
    gc.collect()
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    if not devices:
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # peak RSS starts again from the current RSS


def _peak(devices: list) -> int | None:
    """The peak since _reset_peak: the fullest GPU's allocated bytes, or peak RSS (None if unknown)."""
    if devices:
        return max(torch.cuda.max_memory_allocated(d) for d in devices)
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def _largest(peak: int | None, rt: Runtime) -> int | None:
    """The largest peak over the ranks (each rank's in its own slot of one sum)."""
    slots = [0.0] * rt.world_size
    slots[rt.rank] = float(peak if peak is not None else -1)
    top = max(all_reduce_sum(slots, rt))
    return int(top) if top >= 0 else None


def _agreed_save(where, search: ProbeSearch, rt: Runtime) -> None:
    """Rank 0 records the outcome every rank reached; no rank goes on before it is on disk, so a set
    stopped by a later failure keeps it."""
    if rt.is_main:
        probefile.save(where, search)
    barrier(rt)

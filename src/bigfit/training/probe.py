"""micro-batch auto's probe worker: the model and engine are built once (loop.py) and candidate
micro-batches are tried in sequence in the same processes, each with one full step (forward,
backward, the optimizer step) on this rank's share of the longest samples at lr 0.

One process catches an out-of-memory error, frees what the failed step held and goes on. With
several ranks the others are inside a collective of the failed step, so the error ends the worker
set (OOM_EXIT) and the launcher starts another from the outcomes agreed so far (probefile.py).
Nothing of a probe reaches the real job: its processes exit before the job starts."""
from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Sequence

import torch

from .. import faults, probefile
from ..data.arrays import longest_first
from ..distributed import Runtime, all_reduce_sum, barrier
from ..planning.sizes import ProbeSearch, outcome_text
from ..strategies import Engine
from .job import Job
from .metrics import allocator_flushes
from .step import train_step

# After an in-process OOM an engine may be left half-way through the failed step (the offload engine
# waits for a gradient bucket the failed backward claimed): a step taking longer than this many times
# the slowest seen, or STUCK_MIN_S, ends the process, and a fresh worker set tries that size again
STUCK_FACTOR, STUCK_MIN_S = 10.0, 60.0


def probe(job: Job, engine: Engine, rt: Runtime) -> dict:
    """Run the search in probefile.path(OUTPUT) until it is over; returns its outcomes."""
    cfg, ds = job.cfg, job.dataset
    where = probefile.path(cfg.output_dir)
    search = probefile.load(where).within(len(ds.train) // rt.data.world_size)
    search.worker_sets += 1
    _agreed_save(where, search, rt)
    longest = longest_first(ds.train)
    faults.maybe_die("probe", 0, rt)  # BIGFIT_FAULT=probe:0:0:raise: a probe that fails, not by OOM
    stepped, failed, slowest = False, False, 0.0
    while (micro := search.next()) is not None:
        t0 = time.perf_counter()
        with _deadline(max(STUCK_MIN_S, STUCK_FACTOR * slowest) if failed else None):
            ran, peak, full = _attempt(job, engine, rt, longest, micro, twice=not stepped)
        slowest = max(slowest, time.perf_counter() - t0)
        if not ran and engine.recovers_from_oom:  # its states may be half made: dropped, so step twice again
            engine.recover_from_oom()
        stepped, failed = ran or (stepped and not engine.recovers_from_oom), failed or not ran
        if full:
            _free(engine)  # the next size starts from an empty cache
        search.outcomes.append([micro, ran and not full, _largest(peak, rt) if ran else None])
        _agreed_save(where, search, rt)
        if rt.is_main:
            print(f"probe micro-batch {micro}: {outcome_text(search.outcomes[-1:])} in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        if not ran and not engine.recovers_from_oom and search.next() is not None:
            raise SystemExit(probefile.RETRY_EXIT)  # the next size in new processes, at once
    return {"probes": search.outcomes}


def _attempt(job: Job, engine: Engine, rt: Runtime, longest: Sequence[dict], micro: int,
             twice: bool) -> tuple[bool, int | None, bool]:
    """(ran, peak bytes, whether it ran only by flushing the allocator's cache on some rank: every rank
    takes the same next size) of one step at `micro` (two where the first flushed: the blocks another
    size left cached are not this size's).
    `twice`: no step has run in this process yet, so the optimizer states do not exist during the
    first one's backward; the second meets them, as every training step does. A fixed batch that
    accumulates runs two micro-batches, the second's backward beside the first's gradients, as in
    training."""
    data, cfg = rt.data, job.cfg
    mine = longest[data.rank * micro:(data.rank + 1) * micro]
    accumulated = [mine] * min(2, max(1, cfg.batch_size // data.world_size // micro))
    hook = faults.inject_oom(engine.module, micro)
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
        for _ in range(2 if twice else 1):
            flushes = step()
        full = _any(flushes, rt)
        if full and not twice:  # the blocks another size left cached may need one flush: a settled step
            full = _any(step(), rt)
        ran = True
    except RuntimeError as e:  # torch's OutOfMemoryError is one
        # several ranks: the others wait inside this step's collectives, so this worker set ends (autobatch.py)
        if rt.distributed or not probefile.out_of_memory(e):
            raise
        ran = False  # leaving the except drops the error and its frames, which held the step's activations
    finally:
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


@contextlib.contextmanager
def _deadline(seconds: float | None, expire=lambda: os._exit(probefile.RETRY_EXIT)):
    """Run the body, ending the process if it takes longer than `seconds` (None: no limit)."""
    if seconds is None:
        yield
        return
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


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

"""Fault injection for the crash-safety tests, through BIGFIT_FAULT=<point>:<step>[:<rank>[:raise]].

At that point of that step the given rank (default 0) kills itself with SIGKILL, exactly as the
OOM killer or a machine fault would, or with `raise` fails with an exception instead. Points: `step`
(after the optimizer step and its metrics), `save` (after every rank wrote its part of a
checkpoint, before it is marked complete) and `probe` (step 0: micro-batch auto's probe, before its
first size). Unset, this costs one dictionary look-up per call.
BIGFIT_FAULT=oom-above:<n>[:<t>] makes micro-batch auto's probe steps above n run out of memory, and
training steps above t (a size the probe confirmed that training cannot hold: `bigfit bench` retries);
cublas-above:<n> the same with the RuntimeError cuBLAS raises when a full card has no room for its handle;
flush-above:<n>[:<rank>] makes the probe see the allocator flush its cache in steps above n (on that
rank only, if given). Several faults join with commas.
"""
from __future__ import annotations

import os
import signal


def _spec(prefix: str) -> str:
    """The first of BIGFIT_FAULT's comma-joined faults that starts with `prefix`, or ""."""
    return next((f for f in os.environ.get("BIGFIT_FAULT", "").split(",") if f and f.startswith(prefix)), "")


def maybe_die(point: str, step: int, rt) -> None:
    spec = _spec(point + ":")
    if not spec:
        return
    where, at, rank, action = (spec.split(":") + ["0", "kill"])[:4]
    if where == point and int(at) == step and int(rank) == rt.rank:
        if action == "raise":
            raise RuntimeError(f"injected fault at {point} {step} on rank {rt.rank}")
        os.kill(os.getpid(), signal.SIGKILL)


def inject_oom(module, micro_batch: int, training: bool = False):
    """BIGFIT_FAULT=oom-above:<n>[:<t>] (the probe's tests): a micro-batch larger than n in a probe
    step (t in a training step; none if t is not given) runs out of memory at the end of `module`'s
    forward, as a real error would half-way through a step, with the graph and its activations built.
    Returns the hook's handle to remove, or None."""
    spec = _spec("oom-above:") or _spec("cublas-above:")
    if not spec:
        return None
    limits = spec.split(":")[1:]
    if (training and len(limits) < 2) or micro_batch <= int(limits[int(training)]):
        return None
    import torch

    def fail(*_):
        if spec.startswith("cublas"):
            raise RuntimeError(f"CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)` (injected: "
                               f"micro-batch {micro_batch})")
        raise torch.OutOfMemoryError(f"injected: micro-batch {micro_batch} does not fit")

    return module.register_forward_hook(fail)


def injected_flushes(micro_batch: int, rank: int) -> int:
    """BIGFIT_FAULT=flush-above:<n>[:<rank>]: one allocator cache flush for a probe step above n."""
    spec = _spec("flush-above:").split(":")[1:]
    return int(bool(spec) and micro_batch > int(spec[0]) and (len(spec) < 2 or int(spec[1]) == rank))

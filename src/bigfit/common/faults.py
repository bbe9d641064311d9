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
rank only, if given). BIGFIT_FAULT=enospc:<step>[:<rank>[:<file>]] makes the checkpoint of that step
find the disk full on that rank (default 0) while it writes `file`: shards (DCP's data, the default), rng
(bigfit's rank-N.pt) or marker (COMPLETE). BIGFIT_FAULT=oom-at:<point>:<n>[:<form>] and
hang-at:<point>:<n> make a probe step above micro-batch n run out of memory, or wait for good, at one
point of its path (`at`: forward, backward, reduce, hoststep, fetch, gather, upload, nvme-read,
nvme-write, streamed). Several faults join with commas.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading


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


def maybe_full(file: str, step: int, rank: int, path) -> None:
    """BIGFIT_FAULT=enospc:<step>[:<rank>[:<file>]] (the full-disk tests): writing `file` of the
    checkpoint of `step` on `rank` fails as it does on a full disk, an OSError raised from inside the
    write, so the save's own cleanup and agreement between ranks run as they would for a real one."""
    spec = _spec("enospc:")
    if not spec:
        return
    at, at_rank, at_file, *_ = [*spec.split(":")[1:], None, None]
    if int(at) == step and int(at_rank or 0) == rank and (at_file or "shards") == file:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected)", str(path))


# BIGFIT_FAULT=oom-at:<point>:<n>[:<form>] / hang-at:<point>:<n>, read by `at` inside a probe step
POINTS = {
    "forward": "the start of the model's forward, before any block waits for its parameters",
    "backward": "backward, reaching the first block's output, after the later blocks' gradients went down",
    "reduce": "the offload engine's reduction of a bucket's gradients (transfer.py reduce_to_host, backward)",
    "hoststep": "the offload engine's host thread, before a bucket's Adam step (hoststep.py)",
    "fetch": "the copy of a bucket's device gradients into a pinned slot (--offload-grads device: transfer.py fetch)",
    "gather": "the copy up and all-gather of a bucket's updated values (transfer.py gather)",
    "upload": "the copy of a bucket's gathered values into its parameters (hoststep.py _upload)",
    "nvme-read": "the NVMe tier's read-ahead of a bucket's states (nvme.py prefetch)",
    "nvme-write": "the NVMe tier, once the host step has written a bucket's states to its mapped files",
    "streamed": "zero3-offload's streamed host step of one FSDP2 unit (streamed.py)",
}
_FORMS = {  # what a library says when its own allocation fails (training/probefile.py LIBRARY_OOM)
    "cublas": "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuda": "CUDA error: out of memory",
}
_probing: int | None = None  # the micro-batch of the probe step under way in this process, else None


@contextlib.contextmanager
def probing(micro_batch: int):
    """Inside: a probe step at `micro_batch` (training/probe.py), for `at` on every thread."""
    global _probing
    _probing = micro_batch
    try:
        yield
    finally:
        _probing = None


def at(point: str) -> None:
    """BIGFIT_FAULT=oom-at:<point>:<n>[:<form>]: inside a probe step above micro-batch n, raise here
    torch's OutOfMemoryError (form `oom`, the default) or the RuntimeError a library raises (`cublas`,
    `cuda`), on whatever thread runs `point` (POINTS), so the error takes a real one's way;
    hang-at:<point>:<n>: wait here for good instead, noting nothing (what waits on this thread does).
    Outside a probe step this costs one global read."""
    if _probing is None:
        return
    for spec in os.environ.get("BIGFIT_FAULT", "").split(","):
        kind, _, rest = spec.partition(":")
        where, n, form, *_ = [*rest.split(":"), "", "", "oom"]
        if kind not in ("oom-at", "hang-at") or where != point or _probing <= int(n):
            continue
        if kind == "hang-at":
            threading.Event().wait()  # never set
        said = f"(injected at {point}: micro-batch {_probing})"
        if form in _FORMS:
            raise RuntimeError(f"{_FORMS[form]} {said}")
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory {said}")


def inject_points(module, blocks) -> list:
    """The `forward` and `backward` points of `at` as hooks on `module` (the model) and on the first of
    `blocks` (its transformer blocks in forward order; none: the model itself); their handles."""
    spec, handles = os.environ.get("BIGFIT_FAULT", ""), []
    if "-at:forward:" in spec:
        handles.append(module.register_forward_pre_hook(lambda *_: at("forward")))
    if "-at:backward:" in spec:
        handles.append((blocks[0] if blocks else module).register_forward_hook(_hook_backward))
    return handles


def _hook_backward(module, args, output) -> None:
    import torch

    outputs = output if isinstance(output, (tuple, list)) else [getattr(output, "last_hidden_state", output)]
    first = next((t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if first is not None:
        first.register_hook(lambda grad: at("backward"))

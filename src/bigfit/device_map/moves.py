"""Moving tensors between placements: the one place a device-map copy happens, so it is counted here.

`move(t, place)` returns `t` when it already lives on `place`, else a copy made by `_Copy`, an
autograd function whose backward copies the gradient back (also counted). Copies are remembered
per source tensor (while it lives and is unchanged), so a tensor that several blocks on one device
need (an attention mask, T5's position bias, the encoder's output for every cross-attention) is
copied there once, not once per block, and during `generate()` the encoder output crosses once for
the whole call, not once per step.

Where a tensor lives: its torch device; a CPU tensor may carry a tag naming the virtual `cpu:N`
placement it was copied to or computed on (block outputs are tagged by the hooks). An untagged
CPU tensor lives on the model's main device when that is a CPU placement, else on "cpu".

Copies touching a GPU never block the host (streams.py: copy streams and events). The host waits
only where the CPU reads a GPU's result: in forward, `settle()` waits for this thread's GPU -> CPU
copies (the chunked pipeline starts a stage's copies, lets other micro-batches run, and settles
when this one resumes); in backward, the gradient of a CPU -> GPU copy lands through `_Land`, a
node on the CPU side that autograd runs on the CPU thread, so the GPU's device thread never waits.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..layout.maps import real_device
from . import streams
from .streams import Landing

TAG = "_bigfit_place"
_memo = WeakIdKeyDictionary()  # source tensor -> {place: (version, copy, event)}
_local = threading.local()  # pending GPU -> CPU copy events of this thread
_lock = threading.Lock()  # autograd runs CUDA backward nodes on threads of their own; host segments run beside
_counters: list["CopyCount"] = []


@dataclass
class CopyCount:
    """Cross-placement copies seen while a `count_copies()` block ran."""

    forward: int = 0
    backward: int = 0
    bytes: int = 0
    events: list[tuple[str, str, str, tuple]] = field(default_factory=list)  # (pass, from, to, shape)


class count_copies:  # noqa: N801 (a context manager used like a function)
    """`with count_copies() as c: ...` then c.forward, c.backward, c.bytes, c.events."""

    def __enter__(self) -> CopyCount:
        self.count = CopyCount()
        _counters.append(self.count)
        return self.count

    def __exit__(self, *exc) -> None:
        _counters.remove(self.count)


def _record(direction: str, src: str, dst: str, t: torch.Tensor) -> None:
    if not _counters:
        return
    with _lock:
        for c in _counters:
            setattr(c, direction, getattr(c, direction) + 1)
            c.bytes += t.numel() * t.element_size()
            c.events.append((direction, src, dst, tuple(t.shape)))


def place_of(t: torch.Tensor, cpu_default: str) -> str:
    if t.device.type == "cpu":
        return getattr(t, TAG, cpu_default)
    return f"{t.device.type}:{t.device.index or 0}"


def _raw_copy(t: torch.Tensor, dst: str, landing: Landing | None = None) -> torch.Tensor:
    """`t` copied to placement `dst`. A GPU -> host copy is waited for by `landing` when given (in
    backward), else by this thread's next `settle()`."""
    dev = real_device(dst)
    if t.device == dev:  # between virtual CPU placements: a real copy all the same
        out = t.clone()
    elif t.is_cuda and dev.type == "cpu":
        out, event = streams.gpu_to_host(t)
        if landing is not None:
            landing.event = event
        else:
            pending().append(event)
    elif t.is_cuda:
        out = streams.gpu_to_gpu(t, dev)
    else:
        out = streams.host_to_gpu(t, dev)
    if dev.type == "cpu":
        setattr(out, TAG, dst)
    return out


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, src: str, dst: str, landing):
        ctx.places, ctx.landing = (src, dst), landing
        _record("forward", src, dst, t)
        return _raw_copy(t, dst)

    @staticmethod
    def backward(ctx, grad):
        src, dst = ctx.places
        _record("backward", dst, src, grad)
        landing = ctx.landing or Landing()
        out = _raw_copy(grad, src, landing)
        if ctx.landing is None:  # no CPU node waits for it (the forward's input needed no gradient)
            landing.wait()
        return out, None, None, None


class _Land(torch.autograd.Function):
    """Identity in forward; in backward, on the CPU thread, waits for the gradient's copy from the
    GPU (made by the `_Copy` it feeds, on the GPU's device thread) before handing it on."""

    @staticmethod
    def forward(ctx, t, landing):
        ctx.landing = landing
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.landing.wait()
        return grad, None


def _copy(t: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    if t.device.type == "cpu" and real_device(dst).type == "cuda" and t.requires_grad and torch.is_grad_enabled():
        landing = Landing()
        return _Copy.apply(_Land.apply(t, landing), src, dst, landing)
    return _Copy.apply(t, src, dst, None)


def pending() -> list:
    if not hasattr(_local, "events"):
        _local.events = []
    return _local.events


def settle() -> None:
    """Wait for this thread's GPU -> CPU copies to land before the CPU reads them."""
    events = pending()
    while events:
        events.pop().synchronize()


def move(t: torch.Tensor, dst: str, cpu_default: str) -> torch.Tensor:
    src = place_of(t, cpu_default)
    if src == dst:
        return t
    # a parameter's copy would keep it alive in the memo; an inference tensor has no version to check
    no_memo = (t.is_leaf and t.requires_grad) or t.is_inference()
    if not no_memo:
        with _lock:  # a chunked run's host segments move tensors beside the GPU segments (schedule.py)
            hit = _memo.get(t, {}).get(dst)
        if hit is not None and hit[0] == t._version:
            if hit[2] is not None:
                pending().append(hit[2])  # copied by a micro-batch that has not settled yet
            return hit[1]
    before = len(pending())
    out = _copy(t, src, dst)
    if not no_memo:
        event = pending()[-1] if len(pending()) > before else None
        with _lock:
            _memo.setdefault(t, {})[dst] = (t._version, out, event)
    return out


def move_tree(obj, dst: str, cpu_default: str):
    """Tensors inside tuples, lists and dicts moved; everything else (caches, flags) as it is."""
    if isinstance(obj, torch.Tensor):
        return move(obj, dst, cpu_default)
    if isinstance(obj, (tuple, list)) and type(obj) in (tuple, list):
        return type(obj)(move_tree(x, dst, cpu_default) for x in obj)
    if type(obj) is dict:
        return {k: move_tree(v, dst, cpu_default) for k, v in obj.items()}
    return obj


def tag_tree(obj, place: str) -> None:
    """Mark CPU tensors a block on a virtual placement produced as living there."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            setattr(obj, TAG, place)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            tag_tree(x, place)
    elif isinstance(obj, dict):
        for x in obj.values():
            tag_tree(x, place)

"""A checkpointed block whose saved input lives in host RAM (`--activations offload`).

Checkpointing keeps one tensor per block through the forward pass: its input (the hidden states). With
many blocks and long sequences those inputs are what is left on the device; here each is copied to
pinned host memory on a side stream while the block computes, and brought back just before its recompute.

Why not `torch.autograd.graph.save_on_cpu`: it offloads every tensor autograd saves, each op's inputs
and outputs inside the block (about ten times the block input's bytes, every step, both ways), where
checkpointing already recomputes all of them from the one input that this module moves.

How the input escapes the device: non-reentrant checkpoint keeps the arguments of the function it
checkpoints alive for the recompute. So that function is `_run(handle, marker, *rest)`: `handle` (a
`_Saved`) gives the real hidden states in forward (autograd connects the block's output to them),
copies them to host RAM and drops its reference; in the recompute it gives the copy brought back.
`marker` is an empty tensor on the input's device, so that checkpoint still sees which device's RNG
state and autocast to restore (it looks for them in the tensor arguments only).

Prefetch: the recompute of block i starts the host-to-device copy of block i-1's input, whose backward
comes next, so that copy overlaps block i's backward. Block i-1's handle is the last one this thread
made, if it was made by the block before in the same stack: one forward runs its blocks in order on
one thread (a device map's chunks and a pipeline's micro-batches each on their own, or one after the
other). Not the output's identity: FSDP2's hooks hand the next block a new tensor object. A block
without one (the first of a stack) copies its input back when its recompute begins.

On a machine without CUDA (the tests) nothing can be pinned: the input is cloned into a plain CPU
tensor, synchronously, and the same handle, recompute from the copy and prefetch order run."""
from __future__ import annotations

import collections
import threading
import weakref

import torch
from torch.utils.checkpoint import checkpoint

POOL_SHAPES = 8  # (device, shape, dtype) keys whose free buffers are kept; older ones are released


class _PinnedPool:
    """Pinned host buffers by (device, shape, dtype), reused from step to step (`allocated` counts those
    made). A buffer's copies all run on its device's side stream, in order, so one given back (when its
    handle is freed with the graph) is safe to fill again at once."""

    def __init__(self):
        self.free: collections.OrderedDict = collections.OrderedDict()
        self.lock = threading.Lock()
        self.allocated = 0

    def take(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.device, tuple(x.shape), x.dtype)
        with self.lock:
            if self.free.get(key):
                self.free.move_to_end(key)
                return self.free[key].pop()
            self.allocated += 1
        return torch.empty(key[1], dtype=x.dtype, pin_memory=True)

    def give(self, device: torch.device, buf: torch.Tensor) -> None:
        key = (device, tuple(buf.shape), buf.dtype)
        with self.lock:
            self.free.setdefault(key, []).append(buf)
            self.free.move_to_end(key)
            while len(self.free) > POOL_SHAPES:  # variable sequence lengths: keep the recent shapes only
                self.free.popitem(last=False)


class ActivationOffload:
    """What the offloaded blocks of one model share: the side streams (one per device), the pinned
    pool and counts (`offloaded`, `restored`, `prefetched`: restores a prefetch had started)."""

    def __init__(self):
        self.pool = _PinnedPool()
        self.streams: dict = {}
        self.counts: collections.Counter = collections.Counter()
        self.latest = threading.local()  # .handle: weakref to the last _Saved this thread made

    def made(self, handle: "_Saved"):
        """Record `handle` as this thread's latest; return the block before's handle if it is that one."""
        before = getattr(self.latest, "handle", None)
        before = before() if before is not None else None
        self.latest.handle = weakref.ref(handle)
        if before is not None and before.stack == handle.stack and before.index == handle.index - 1:
            return weakref.ref(before)
        return None

    def side(self, device: torch.device):
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device=device)
        return self.streams[device]


class _Saved:
    """One call's block input: on the device until the block starts, then in host RAM."""

    def __init__(self, owner: ActivationOffload, x: torch.Tensor, keyword: bool, stack: int, index: int):
        self.owner, self.keyword, self._x, self.stack, self.index = owner, keyword, x, stack, index
        self.device, self.requires_grad = x.device, x.requires_grad
        self.dtensor = _dtensor_meta(x)
        self.prev = owner.made(self)  # weakref to the previous block's handle: prefetched in our recompute
        self.host = self._dev = self._event = None
        self.pinned = False

    def get(self) -> torch.Tensor:
        """The input: the real one in forward (copied out, then let go), the copy in a recompute."""
        if self._x is None:
            return self._restore()
        x, self._x = self._x, None
        local = x.detach().to_local() if self.dtensor else x.detach()
        self.pinned = local.is_cuda
        if self.pinned:
            buf = self.owner.pool.take(local)
            side = self.owner.side(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))  # x is written on the compute stream
            with torch.cuda.stream(side):
                buf.copy_(local, non_blocking=True)
            local.record_stream(side)  # its memory is not reused before the copy has read it
            weakref.finalize(self, self.owner.pool.give, self.device, buf)  # back when the graph is freed
            self.host = buf
        else:
            self.host = local.to("cpu", copy=True)  # synchronous: nothing to pin without CUDA
        self.owner.counts["offloaded"] += 1
        return x

    def prefetch(self) -> None:
        """Start bringing the input back (the block before the one in backward now)."""
        if self._dev is not None or self.host is None:
            return
        if not self.pinned:
            self._dev = self.host.detach().to(self.device)
            return
        # allocated on the compute stream, filled on the side one: the side stream first waits for the
        # compute stream's work queued so far, which may still read this memory's previous tensor
        dev = torch.empty_like(self.host, device=self.device)
        side = self.owner.side(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            dev.copy_(self.host, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(side)
        dev.record_stream(side)  # a prefetch never consumed (no backward) is freed safely too
        self._dev = dev

    def _restore(self) -> torch.Tensor:
        self.owner.counts["restored"] += 1
        self.owner.counts["prefetched"] += self._dev is not None
        self.prefetch()
        dev, event, self._dev, self._event = self._dev, self._event, None, None
        previous = self.prev() if self.prev is not None else None
        if previous is not None:
            previous.prefetch()  # overlaps this block's backward
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        # requires_grad as in forward, so the recompute saves the tensors the forward saved
        return _as_dtensor(dev, self.dtensor).requires_grad_(self.requires_grad) if self.dtensor else \
            dev.requires_grad_(self.requires_grad)


def _dtensor_meta(x: torch.Tensor):
    """(mesh, placements, shape, stride) of a DTensor input (tensor parallel's sequence-split residual
    stream): its local shard is what moves."""
    from torch.distributed.tensor import DTensor

    return (x.device_mesh, x.placements, x.shape, x.stride()) if isinstance(x, DTensor) else None


def _as_dtensor(local: torch.Tensor, meta) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = meta
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class OffloadedForward:
    """A block's forward under non-reentrant checkpoint with its input kept in host RAM. The input is
    the first positional argument or the keyword `hidden_states`; the other arguments (masks, position
    embeddings: shared by every block) stay where they are. Without grad (evaluation, generation)
    nothing is saved for backward and the block runs as checkpoint runs it.

    Eager under --compile: dynamo would trace the handle's bookkeeping (weak references, thread-local
    state, streams) into the graph, and a checkpointed function with side effects falls back to eager
    anyway; blocks past `--checkpoint-blocks` still compile."""

    def __init__(self, forward, owner: ActivationOffload, stack: int, index: int):
        self.forward, self.owner, self.stack, self.index = forward, owner, stack, index

    @torch.compiler.disable
    def __call__(self, *args, **kwargs):
        keyword = not (args and isinstance(args[0], torch.Tensor))
        x = kwargs.get("hidden_states") if keyword else args[0]
        if not torch.is_grad_enabled() or not isinstance(x, torch.Tensor):
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        rest = args if keyword else args[1:]
        kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"} if keyword else kwargs
        handle = _Saved(self.owner, x, keyword, self.stack, self.index)
        marker = torch.empty(0, device=handle.device)
        del x, args  # the handle alone holds the input now
        return checkpoint(self._run, handle, marker, *rest, use_reentrant=False, **kwargs)

    def _run(self, handle: _Saved, _marker, *args, **kwargs):
        x = handle.get()
        return self.forward(*args, hidden_states=x, **kwargs) if handle.keyword else self.forward(x, *args, **kwargs)

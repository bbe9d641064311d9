"""The GPipe clock inside one process: `run_chunks` makes one call per micro-batch, each on a pool
thread, and switches between them where a micro-batch changes device (the hooks call `reached`).

Why threads: a Hugging Face forward is one Python call from the embeddings to the loss. For stage s
to work on micro-batch t - s at tick t, micro-batch t's call must stop where it leaves a device
while another's goes on, so each call needs a stack of its own; a thread also keeps each call's
thread-local state (grad mode, autocast, checkpointing's saved-tensor hooks) to itself. Only one
runs at a time: their Python would take turns on the GIL anyway, and a fixed issue order is what
keeps every device's stream in GPipe order. Kernel launches being asynchronous is not enough without
the switching: issued one micro-batch after another, the main GPU's stream would hold micro-batch
m's head (which waits for the last stage's work on m) ahead of m + 1's first stage.

The clock: micro-batch m runs its j-th device segment at tick m + j. Within a tick, segments on GPUs
go first, earliest stage first. They only queue kernels on their device's stream (copies wait on
events, streams.py), so the host reaches the CPU segments at once: the CPU computes micro-batch
i - 1 while the GPU runs what was just queued for micro-batch i, waiting only for the host copy of
its own input. On the CPU alone the same schedule runs the segments one after another.

Backward is one autograd call over the sum of the losses (pipeline.py says why). Autograd orders
ready nodes by a sequence number that is counted per thread, so nodes of micro-batches built on
different threads would tie and every stage would interleave all micro-batches, finishing them all
at the end (the next stage idle until then). `ordered_backward` adds edges instead: the first hidden
state of segment j of micro-batch m that needs a gradient is tied to every tensor that left
segment j of micro-batch m - 1 (`_After`), so a stage starts micro-batch m - 1's backward only
when m's has reached the segment's start, and hands each on as soon as it is done: GPipe's
backward, last micro-batch first.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import queue
import threading

import torch

from ..errors import BigfitError
from .maps import is_cuda

_current = threading.local()


class _Aborted(BaseException):
    """Unwinds a paused micro-batch when another one failed."""


class _After(torch.autograd.Function):
    """`x` unchanged. In backward, the gradients of `tokens` are complete only once this node has
    run, so the segment that produced them starts its backward after the one that used `x`. Their
    gradients from here are None: edges for order, no values (nothing added, nothing allocated)."""

    @staticmethod
    def forward(ctx, x, *tokens):
        ctx.tokens = len(tokens)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * ctx.tokens


def reached(place: str, sent=None, received=None):
    """Called by the hooks where a micro-batch is about to compute on `place`, with the tensors as
    they were (`sent`, any tree) and the hidden state as moved there (`received`). In a chunked run,
    a change of device ends this thread's segment. Returns `received`, tied into the backward order
    when asked."""
    worker = getattr(_current, "worker", None)
    if worker is None:
        return received
    if place != worker.place:
        worker.cross(place, sent)
    return worker.anchor(received)


def _caller_state():
    """Grad mode, autocast, the CUDA device and its stream, and context variables are per thread:
    workers take the caller's (other GPUs' streams are not asked for: that would open a context on
    every GPU of the machine)."""
    autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
    grad, cache = torch.is_grad_enabled(), torch.is_autocast_cache_enabled()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.cuda.current_device() if cuda else None
    stream = torch.cuda.current_stream(device) if cuda else None

    def enter(stack: contextlib.ExitStack) -> None:
        stack.enter_context(torch.set_grad_enabled(grad))
        for dev_type, dtype in autocast:
            stack.enter_context(torch.autocast(dev_type, dtype=dtype, cache_enabled=cache))
        if device is not None:
            torch.cuda.set_device(device)
            stack.enter_context(torch.cuda.stream(stream))
    return enter


class _Worker:
    """One micro-batch's call, run on a pool thread, one segment per turn."""

    def __init__(self, index: int, fn, arg, place: str, enter, tokens: dict | None):
        self.index, self.fn, self.arg, self.place, self.enter = index, fn, arg, place, enter
        self.tokens, self.segment, self.anchored = tokens, 0, False  # backward order (module docstring)
        self.turn, self.parked = threading.Event(), threading.Event()
        self.done, self.abort, self.result, self.error = False, False, None, None
        self.context = contextvars.copy_context()

    def main(self) -> None:
        _current.worker = self
        try:
            self._wait_turn()
            with contextlib.ExitStack() as stack:
                self.enter(stack)
                self.result = self.fn(self.arg)
        except _Aborted:
            pass
        except BaseException as e:  # handed to the caller's thread
            self.error = e
        finally:
            _current.worker = None
            self.done = True
            self.parked.set()

    def _wait_turn(self) -> None:
        self.turn.wait()
        self.turn.clear()
        if self.abort:
            raise _Aborted()

    def cross(self, place: str, sent) -> None:
        """In this worker's thread, at a change of device: end the segment, wait for the next turn."""
        if self.tokens is not None:
            self.tokens[(self.index, self.segment)] = [t for t in _tensors(sent) if t.requires_grad]
        self.place, self.segment, self.anchored = place, self.segment + 1, False
        self.parked.set()
        self._wait_turn()

    def anchor(self, received):
        """The segment's first hidden state that needs a gradient, tied after micro-batch index - 1's."""
        if (self.tokens is None or self.anchored or not isinstance(received, torch.Tensor)
                or not received.requires_grad or not torch.is_grad_enabled()):
            return received
        self.anchored = True
        tokens = self.tokens.get((self.index - 1, self.segment))
        return _After.apply(received, *tokens) if tokens else received

    def resume(self) -> None:
        """In the scheduler's thread: run this worker until it pauses or ends."""
        self.parked.clear()
        self.turn.set()
        self.parked.wait()


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


class _PoolThread:
    """A thread kept for the next step: CPU work in a fresh thread each step paid for cold per-thread
    state (allocator arena, OpenMP team) every time."""

    def __init__(self, index: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name=f"bigfit-chunk-{index}").start()

    def _loop(self) -> None:
        while True:
            worker = self.jobs.get()
            worker.context.run(worker.main)


_pool: list[_PoolThread] = []
_pool_pid = [os.getpid()]  # a forked child has none of its parent's threads: it starts a pool of its own
_running = threading.Lock()  # one chunked run at a time: the pool threads serve one schedule


def run_chunks(fn, inputs: list, main: str, trace: list | None = None, *, ordered_backward: bool = False) -> list:
    """[fn(x) for x in inputs], the calls interleaved in GPipe order over the devices they reach
    (`main`: where each call starts). `trace`, if given, gets (clock, micro-batch, device) per segment.
    `ordered_backward`: tie the micro-batches' graphs so that one backward over the sum of the
    results runs each stage's micro-batches in reverse order; then only that sum may be
    backpropagated (a result's backward alone would run through its neighbours' graphs)."""
    if getattr(_current, "worker", None) is not None:
        raise BigfitError("run_chunks cannot run inside a chunk of another run_chunks")
    enter = _caller_state()
    tokens = {} if ordered_backward else None
    with _running:
        if _pool_pid[0] != os.getpid():
            _pool.clear()
            _pool_pid[0] = os.getpid()
        _pool.extend(_PoolThread(i) for i in range(len(_pool), len(inputs)))
        workers = [_Worker(i, fn, x, main, enter, tokens) for i, x in enumerate(inputs)]
        for w, t in zip(workers, _pool):
            t.jobs.put(w)
        try:
            _schedule(workers, trace)
        finally:
            for w in workers:  # unwind the paused ones after a failure
                if not w.done:
                    w.abort = True
                    w.resume()
    return [w.result for w in workers]


def idle() -> bool:
    """No chunked run in progress (every pool thread is waiting for work)."""
    return not _running.locked()


def _schedule(workers: list[_Worker], trace: list | None) -> None:
    """Micro-batch m runs its j-th segment at clock m + j. Within a clock, GPU segments first (they
    only queue work), and among them the earliest stage (the latest micro-batch) first: its output
    is what the next stage needs at the next clock, so its copy is queued behind the least work."""
    clock = 0
    while not all(w.done for w in workers):
        due = [w for w in workers[:clock + 1] if not w.done]
        for w in sorted(due, key=lambda w: (not is_cuda(w.place), -w.index)):
            if trace is not None:
                trace.append((clock, w.index, w.place))
            w.resume()
            if w.error is not None:
                raise w.error
        clock += 1

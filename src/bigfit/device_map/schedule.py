"""The GPipe clock inside one process: `run_chunks` makes one call per micro-batch, each on a pool
thread, and switches between them where a micro-batch changes device (the hooks call `reached`).

Why threads: a Hugging Face forward is one Python call from the embeddings to the loss. For stage s
to work on micro-batch t - s at tick t, micro-batch t's call must stop where it leaves a device
while another's goes on, so each call needs a stack of its own; a thread also keeps each call's
thread-local state (grad mode, autocast, checkpointing's saved-tensor hooks) to itself. Kernel
launches being asynchronous is not enough without the switching: issued one micro-batch after
another, the main GPU's stream would hold micro-batch m's head (which waits for the last stage's
work on m) ahead of m + 1's first stage.

The clock: micro-batch m runs its j-th device segment at tick m + j. A tick's GPU segments run one
at a time, earliest stage first, from the scheduler's thread: their Python would take turns on the
GIL anyway, and a fixed issue order keeps every GPU's stream in GPipe order. They only queue
kernels (copies wait on events, streams.py), but issuing them is host work too, and where a
segment is bound by its launches (small micro-batches), its GPU finishes about when the host stops
issuing. So a tick's host segments run beside the GPU segments, on a thread of their own
(threads.Beside): a host segment spends its time in torch's CPU kernels, which release the GIL,
and the CPU computes micro-batch i - 1 while the scheduler's thread issues micro-batch i's kernels,
waiting only for the host copy of its own input. Each device is still driven by one thread at a
time, so no module runs on two threads at once. Without GPU segments in the tick (on the CPU
alone, or the tests' virtual `cpu:N` devices) the segments run one after another.

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
import functools
import threading

import torch

from ..errors import BigfitError
from ..layout.maps import is_cuda
from .threads import Pool

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


_pool = Pool()
_running = threading.Lock()  # one chunked run at a time: the pool threads serve one schedule
HOST_BESIDE = True  # False: a tick's host segments run after its GPU segments (benchmarks compare)


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
        workers = [_Worker(i, fn, x, main, enter, tokens) for i, x in enumerate(inputs)]
        for w, t in zip(workers, _pool.workers(len(inputs))):
            t.jobs.put(functools.partial(w.context.run, w.main))
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
    """Micro-batch m runs its j-th segment at clock m + j. Within a clock, GPU segments in order, the
    earliest stage (the latest micro-batch) first: its output is what the next stage needs at the
    next clock, so its copy is queued behind the least work. Host segments run beside them, on a
    thread of their own (module docstring); without GPU segments in the clock, in the same order."""
    clock = 0
    while not all(w.done for w in workers):
        due = sorted((w for w in workers[:clock + 1] if not w.done), key=lambda w: (not is_cuda(w.place), -w.index))
        if trace is not None:
            trace.extend((clock, w.index, w.place) for w in due)
        gpus = [w for w in due if is_cuda(w.place)]
        hosts = due[len(gpus):]
        if gpus and hosts and HOST_BESIDE:
            beside = _pool.beside()
            beside.start(_run, hosts)
            try:
                _run(gpus)
            finally:
                beside.wait()  # no worker is resumed from two threads, also when unwinding
            beside.join()
        else:
            _run(due)
        clock += 1


def _run(workers: list[_Worker]) -> None:
    for w in workers:
        w.resume()
        if w.error is not None:
            raise w.error

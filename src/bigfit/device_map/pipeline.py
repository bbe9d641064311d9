"""GPipe-style micro-batching inside one process (`chunks=N`), so that the devices of a split model
work at the same time, with no change to the model and no extra processes.

Each micro-batch's forward runs on its own thread (a pool kept across steps), but only one runs at
a time: a thread stops where its micro-batch changes device (the hooks call `reached`), and the
scheduler resumes the threads in GPipe order: micro-batch m runs its j-th device segment at clock m + j, so stage s
works on micro-batch m while stage s+1 works on m-1. Within a clock, segments on CUDA devices go
first: their kernels are queued and run on that GPU (each device on its own stream) while the
host computes the CPU segments, so a GPU and the CPU really overlap; on the CPU alone the same
schedule runs sequentially. Copies between stages are started before a thread stops and waited
for when it resumes (moves.py), so one micro-batch's transfer never waits for the next one's work.

Backward is one autograd call over all micro-batches (GPipe: all forwards, then all backwards);
autograd runs each CUDA device's part on its own thread, which pipelines backward by itself.
Dropout draws differ from an unchunked run (different call order), as in any pipeline.
Each micro-batch pays again for what a step does per parameter (autocast's weight casts, gradient
accumulation): chunks pay off on compute-bound stages, not on a host stage (docs/device_map.md).
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


def reached(place: str) -> None:
    """Called by the hooks where a micro-batch is about to compute on `place`: in a chunked run,
    a change of device ends this thread's segment."""
    worker = getattr(_current, "worker", None)
    if worker is not None and place != worker.place:
        worker.place = place
        worker.pause()


def _caller_state():
    """Grad mode, autocast and context variables are per thread: the workers take the caller's."""
    autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
    grad, cache = torch.is_grad_enabled(), torch.is_autocast_cache_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def enter(stack: contextlib.ExitStack) -> None:
        stack.enter_context(torch.set_grad_enabled(grad))
        for dev_type, dtype in autocast:
            stack.enter_context(torch.autocast(dev_type, dtype=dtype, cache_enabled=cache))
        if device is not None:
            torch.cuda.set_device(device)
    return enter


class _Worker:
    """One micro-batch's call, run on a pool thread, one segment per turn."""

    def __init__(self, index: int, fn, arg, place: str, enter):
        self.index, self.fn, self.arg, self.place, self.enter = index, fn, arg, place, enter
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

    def pause(self) -> None:
        """In this worker's thread: hand control back, wait for the next turn."""
        self.parked.set()
        self._wait_turn()

    def resume(self) -> None:
        """In the scheduler's thread: run this worker until it pauses or ends."""
        self.parked.clear()
        self.turn.set()
        self.parked.wait()


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


def run_chunks(fn, inputs: list, main: str, trace: list | None = None) -> list:
    """[fn(x) for x in inputs], the calls interleaved in GPipe order over the devices they reach
    (`main`: where each call starts). `trace`, if given, gets (clock, micro-batch, device) per segment."""
    if getattr(_current, "worker", None) is not None:
        raise BigfitError("run_chunks cannot run inside a chunk of another run_chunks")
    enter = _caller_state()
    with _running:
        if _pool_pid[0] != os.getpid():
            _pool.clear()
            _pool_pid[0] = os.getpid()
        _pool.extend(_PoolThread(i) for i in range(len(_pool), len(inputs)))
        workers = [_Worker(i, fn, x, main, enter) for i, x in enumerate(inputs)]
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
    """Micro-batch m runs its j-th segment at clock m + j; within a clock, CUDA segments first."""
    clock = 0
    while not all(w.done for w in workers):
        due = [w for w in workers[:clock + 1] if not w.done]
        for w in sorted(due, key=lambda w: (not is_cuda(w.place), w.index)):
            if trace is not None:
                trace.append((clock, w.index, w.place))
            w.resume()
            if w.error is not None:
                raise w.error
        clock += 1


def split_batch(batch: dict, chunks: int) -> list[dict]:
    """Split every tensor along dim 0 into `chunks` micro-batches (sizes differ by at most one)."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor)}
    if len(sizes) != 1:
        raise BigfitError(f"chunks: the batch's tensors disagree on the batch size ({sorted(sizes)})")
    n = sizes.pop()
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= n:
        raise BigfitError(f"chunks must be an integer from 1 to the batch size {n}, got {chunks!r}")
    parts = {k: torch.tensor_split(v, chunks) if isinstance(v, torch.Tensor) else [v] * chunks
             for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(chunks)]


def _target_tokens(model, part: dict) -> int:
    """Tokens a Hugging Face loss averages over: labels other than -100 (shifted by one for causal LMs)."""
    labels = part["labels"]
    seq2seq = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return int(((labels if seq2seq else labels[:, 1:]) != -100).sum())


def train_step(model: torch.nn.Module, batch: dict, chunks: int = 1) -> torch.Tensor:
    """Forward and backward of `batch` (with `labels`) through a parallelized model, as `chunks`
    micro-batches run in GPipe order. The model's own loss is a token mean per call, so each
    chunk's loss is weighted by its share of the batch's target tokens: loss and gradients are
    those of one unchunked call. Returns the (detached) loss; the optimizer step is the caller's."""
    from .hooks import layout_of

    layout = layout_of(model)
    if layout is None:
        raise BigfitError("train_step needs a parallelized model; call parallelize(model, device_map) first")
    parts = split_batch(batch, chunks)
    counts = [_target_tokens(model, p) for p in parts]
    total = sum(counts)
    if total == 0:
        raise BigfitError("train_step: the batch has no target tokens (every label is -100)")
    losses = run_chunks(lambda part: model(**part).loss, parts, layout.main)
    loss = sum(l * (n / total) for l, n in zip(losses, counts) if n)  # a chunk with no targets adds nothing
    loss.backward()
    return loss.detach()

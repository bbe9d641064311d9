"""The offload engine's host thread (engine.py): one per host step. It takes each bucket's
gradients as they land (host buffers, or the device through gradslots.py), steps the bucket with a
fused CPU Adam (kernels/cpu_adam.py's kernel, else torch's), which also unscales and clips (it divides each
gradient by `grad_scale`), and copies the bucket's master weights up (transfer.py), so the next
forward's blocks can start while the buckets behind them still update. In delayed mode each
bucket's copy up waits for the next backward to finish that bucket's gradients (`_upload_stale`,
from its hook) or for `flush`. An error on the thread is kept and re-raised on the training thread,
which would otherwise wait forever. Every wait is noted (common/waits.py), so a deadline can say what it
was for, and a step abandoned after an out-of-memory error stops the thread where it waits for
gradients that will never come (`_stopping`, engine.py `abandon_step`)."""
from __future__ import annotations

import contextlib
import threading
import time

import torch

from ..common import faults, waits
from ..kernels import cpu_adam
from . import statefmt
from .buckets import Bucket, unpack

EXIT_JOIN_S = 60.0  # the longest the interpreter's exit waits for a host step (join_at_exit)


class _Abandoned(Exception):
    """The step this host step belongs to was abandoned: its gradients never come."""


class HostSteps:
    """Mixed into OffloadEngine, whose state it uses: buckets, inners, masters, io, slots, store,
    param_groups, dtype, state_format, kernel, trace, _worker, _error, _stopping, _phase."""

    def _start_host_step(self, grad_scale: float, order: list[Bucket], upload: bool) -> None:
        self._join()
        self._grad_scale = grad_scale  # the fused step divides every gradient by it: unscale and clip
        for inner in self.inners:
            inner.param_groups[0].update(self.param_groups[0])
        for b in order:
            b.state["stepped"].clear()
            b.state["stale"] = not upload  # delayed: updated masters that the device does not have yet
            if upload:
                b.state["issued"].clear()
        self._worker = threading.Thread(target=self._host_steps, args=(order, upload), daemon=True,
                                        name="the offload engine's host step")
        self._worker.start()

    @torch.no_grad()
    def _host_steps(self, order: list[Bucket], upload: bool) -> None:
        done, freed = 0, set()  # buckets handed back, and whose gradients were read (see `finally`)
        try:
            self.io.enter_thread()
            if self.slots:
                self.slots.reset()
            for i, b in enumerate(order):
                with self._span("wait-gradients", b):
                    if self.slots:
                        grad = self.slots.take(order, i, self._landing)
                    else:
                        grad = self.grad_buffers[b.index]
                        self._landing(b)
                        b.state["reduced"].clear()
                    with waits.waiting(f"the device's copies of {self._named(b)}"):
                        self.io.wait_landed(b.state)
                if self.slots:  # in host RAM now: the next backward may reduce this bucket again
                    b.state["free"].set()
                    freed.add(b.index)
                if self.store and i + 1 < len(order):
                    self.store.prefetch(order[i + 1].index)  # the disk reads ahead while this bucket updates
                with self._span("cpu-adam", b):
                    faults.at("hoststep")
                    self._adam(b, grad)
                    if self.store and self.store.holds(b.index):  # its states written to their mapped files
                        faults.at("nvme-write")
                b.state["stepped"].set()
                if b.index not in freed:
                    b.state["free"].set()
                    freed.add(b.index)
                if upload:
                    with self._span("upload", b):
                        self._upload(b)
                    b.state["issued"].set()
                done = i + 1
        except _Abandoned:
            pass
        except BaseException as e:  # re-raised on the training thread, which would otherwise wait forever
            self._error = e
        finally:
            # Never set `free` again for a bucket already handed back: the next backward (delayed and
            # eager modes overlap it with this thread) may have cleared it and refilled the bucket's
            # host gradients, and a second `free` would let a third write land before they are read.
            for b in order[done:]:
                if b.index not in freed:
                    b.state["free"].set()
                b.state["issued"].set()
                b.state["stepped"].set()  # waiters find the error (`_raise`) instead of waiting forever

    def _landing(self, b: Bucket) -> None:
        """Wait until bucket b's gradients are reduced, unless its step is abandoned meanwhile."""
        waits.wait(b.state["reduced"], f"the gradients of {self._named(b)}")
        if self._stopping:
            raise _Abandoned

    def _named(self, b: Bucket) -> str:
        return f"bucket {b.index + 1} of {len(self.buckets)}"

    def _adam(self, b: Bucket, grad: torch.Tensor) -> None:
        inner, master = self.inners[b.index], self.masters[b.index]
        if self.state_format != "fp32":  # the kernel, else its plain-torch reference (slower)
            statefmt.step(inner, master, grad, self._grad_scale, b, self.io.rank, self.kernel)
            return
        if self.kernel:
            cpu_adam.step(inner, master, grad, self._grad_scale)
            return
        master.grad, inner.grad_scale = grad, torch.tensor(self._grad_scale)
        inner.step()
        master.grad = None

    @contextlib.contextmanager
    def _span(self, what: str, b: Bucket | None = None):
        start = time.perf_counter()
        if threading.current_thread() is self._worker:  # where the host step is, for a deadline's message
            self._phase = f"{what}, {self._named(b)}"
        yield
        if self.trace is not None:
            self.trace.append((what, b.index if b else -1, start, time.perf_counter()))

    def _upload(self, b: Bucket) -> None:
        faults.at("upload")
        with self.io.uploading(b.state):
            gathered = self.io.gather(self.masters[b.index], self.dtype)
            for s in b.slots:
                unpack(gathered, s, s.param.data)

    @torch.no_grad()
    def _upload_stale(self, buckets: list[Bucket]) -> None:
        """Delayed mode: copy these buckets' finished updates up, once the host step has made them,
        after the device's work so far (which may still read the parameters they replace)."""
        for b in buckets:
            waits.wait(b.state["stepped"], f"the host step's update of {self._named(b)}")
            self._raise()
        self.io.after_current_work()
        for b in buckets:
            with self._span("upload", b):  # on the training thread (a hook), unlike the other modes' uploads
                self._upload(b)
            b.state["stale"] = False

    def _upload_pending(self) -> None:
        """Delayed mode: the updates that no hook has copied up yet (before the next host step, flush)."""
        self._join()
        self._upload_stale([b for b in reversed(self.buckets) if b.state["stale"]])  # the next host step's order

    def _join(self, timeout: float | None = None) -> None:
        """The host step ended (a RuntimeError saying where it is if not within `timeout` s); its error raised."""
        if self._worker is not None:
            if not waits.join(self._worker, lambda: f"the offload engine's host step (at {self._phase})", timeout):
                raise RuntimeError(f"the offload engine's host step did not end within {timeout:g} s: it is at "
                                   f"{self._phase}")
            self._worker = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the offload engine's host step failed") from error


def join_at_exit(ref) -> None:
    """At the interpreter's exit: a host step still under way ends first (a daemon thread still inside
    torch then aborts the process), but within EXIT_JOIN_S: one that waits for what never comes (a
    step that failed) must not keep the process alive for good."""
    engine = ref()
    if engine is not None and engine._worker is not None:
        what = lambda: f"the offload engine's host step (at {engine._phase}) before exiting"  # noqa: E731
        if not waits.join(engine._worker, what, waits.limit(EXIT_JOIN_S)):
            print(f"exiting without the offload engine's host step, still at {engine._phase} after "
                  f"{waits.limit(EXIT_JOIN_S):g} s", flush=True)

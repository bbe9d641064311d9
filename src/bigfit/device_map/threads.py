"""The threads a chunked run uses, kept from one step to the next: one per micro-batch (its call's
stack, schedule.py) and one that runs a tick's host segments beside the GPUs' (`Beside`).

Kept, not started per step: CPU work in a fresh thread each step paid for cold per-thread state
(allocator arena, OpenMP team) every time. A forked child has none of its parent's threads, so it
starts threads of its own.
"""
from __future__ import annotations

import os
import queue
import threading


class _Thread:
    """A daemon thread that runs the callables put to it, one after another."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name=name).start()

    def _loop(self) -> None:
        while True:
            self.jobs.get()()


class Beside:
    """Runs a list of segments (`run(workers)`) on a thread of its own while the caller's thread
    runs others; `join` waits for them and raises the first error among them."""

    def __init__(self):
        self._thread = _Thread("bigfit-chunk-host")
        self._done = threading.Event()
        self._error: BaseException | None = None

    def start(self, run, workers: list) -> None:
        self._done.clear()
        self._error = None
        self._thread.jobs.put(lambda: self._job(run, workers))

    def _job(self, run, workers: list) -> None:
        try:
            run(workers)
        except BaseException as e:  # handed to the scheduler's thread by `join`
            self._error = e
        finally:
            self._done.set()

    def wait(self) -> None:
        """Until the segments have run or failed (also while an error of the caller's unwinds)."""
        self._done.wait()

    def join(self) -> None:
        self.wait()
        if self._error is not None:
            raise self._error


class Pool:
    """`workers(n)`: at least n micro-batch threads; `beside()`: the host-segment thread."""

    def __init__(self):
        self._pid, self._threads, self._beside = os.getpid(), [], None

    def _fresh(self) -> None:
        if self._pid != os.getpid():
            self._pid, self._threads, self._beside = os.getpid(), [], None

    def workers(self, n: int) -> list[_Thread]:
        self._fresh()
        self._threads.extend(_Thread(f"bigfit-chunk-{i}") for i in range(len(self._threads), n))
        return self._threads

    def beside(self) -> Beside:
        self._fresh()
        if self._beside is None:
            self._beside = Beside()
        return self._beside

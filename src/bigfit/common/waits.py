"""Waits that say what they wait for, and deadlines that name them.

A thread about to block on another (an event it sets, its end, the device's queued work) notes what
for (`waiting`, `wait`, `join`), so that a deadline that expires can say which thread waited how long
for what (`now`) instead of leaving a process that prints nothing: micro-batch auto's probe bounds
each step, an engine's recovery from an out-of-memory error and its processes' exit this way
(training/probewatch.py), and its launcher waits for the workers no longer than they said
(commands/autobatch.py). A probe whose search was over once sat more than four minutes in a process that
never exited, saying nothing (gpt-neo-1.3B's shape on a 16 GB cap): on the CPU, an offload engine's
host thread waited for gradients that a recovery had cleared, and the interpreter's exit joined it.
BIGFIT_WAIT_S, where set, replaces every such deadline (the tests': a few seconds)."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

ENV = "BIGFIT_WAIT_S"
What = str | Callable[[], str]  # what a thread waits for; a callable says it as it is when asked
_waits: dict[int, tuple[What, float]] = {}  # thread ident -> (what it waits for, since when)


def limit(default: float) -> float:
    """A deadline in seconds: `default`, or BIGFIT_WAIT_S where set."""
    given = os.environ.get(ENV)
    return float(given) if given else default


@contextlib.contextmanager
def waiting(what: What):
    """The calling thread waits for `what` inside."""
    me = threading.get_ident()
    outer = _waits.get(me)
    _waits[me] = (what, time.monotonic())
    try:
        yield
    finally:
        if outer is None:
            _waits.pop(me, None)
        else:
            _waits[me] = outer


def wait(event: threading.Event, what: What, timeout: float | None = None) -> bool:
    """event.wait(timeout), noted as a wait for `what` (nothing noted where it is set already)."""
    if event.is_set():
        return True
    with waiting(what):
        return event.wait(timeout)


def join(thread: threading.Thread, what: What, timeout: float | None = None) -> bool:
    """thread.join(timeout), noted; whether the thread has ended."""
    with waiting(what):
        thread.join(timeout)
    return not thread.is_alive()


def now() -> str:
    """What each thread of this process waits for, and how long it has: "the main thread, 61 s for the
    offload engine's host step (at cpu-adam of bucket 3)"."""
    names = {t.ident: t.name for t in threading.enumerate()}
    at = time.monotonic()
    said = [f"{_name(names.get(ident))}, {at - since:.0f} s for {what() if callable(what) else what}"
            for ident, (what, since) in list(_waits.items())]
    return "; ".join(said) or "no thread waited for another: a computation or a library call did not return"


def _name(thread: str | None) -> str:
    return "the main thread" if thread == "MainThread" else thread or "a thread that has ended"

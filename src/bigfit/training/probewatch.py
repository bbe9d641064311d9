"""The deadlines of micro-batch auto's probe workers (training/probe.py). Each probe step, with its
recovery from an out-of-memory error, ends by its deadline, and the process exits by another after
its search, or ends itself there, saying in its log and to the launcher (probefile.py `note`) what
each of its threads waited for (common/waits.py). The launcher then goes on in new processes (a step that
did not end after an OOM in the same process: the engine may be half-way through the failed step),
stops in one line (a step of fresh processes), or trains (the search was over: commands/autobatch.py).

A step's deadline: STUCK_FACTOR times the slowest step so far in this process, at least
STUCK_MIN_S; FIRST_STEP_S for a process's first (cuBLAS starting, the optimizer states made, a
compile); the exit's: EXIT_S. BIGFIT_WAIT_S, where set, replaces each."""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ..common import waits
from ..common.processes import write_error
from . import probefile

STUCK_FACTOR, STUCK_MIN_S = 10.0, 60.0
FIRST_STEP_S = 900.0  # generous: only a step that never ends should meet it
EXIT_S = 60.0


@dataclass
class StepClock:
    """What a step's deadline in this process follows from."""

    slowest: float = 0.0  # the longest a probe step (with its recovery) has taken here
    failed: bool = False  # a size ran out of memory in this process

    def deadline(self) -> float:
        if self.slowest == 0.0:
            return waits.limit(FIRST_STEP_S)
        return waits.limit(max(STUCK_MIN_S, STUCK_FACTOR * self.slowest))


@contextlib.contextmanager
def deadline(seconds: float | None, expire):
    """Run the body, calling `expire()` from another thread if it takes longer than `seconds` (None: no limit)."""
    if seconds is None:
        yield
        return
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def stuck(where: Path, micro: int, seconds: float, failed: bool, rank: int) -> None:
    """A probe step passed its deadline: say what it waited for and end the process (RETRY_EXIT after
    an out-of-memory error in it, else STUCK_EXIT)."""
    text = (f"its step did not end within {seconds:g} s" + (" after an out-of-memory error in the same processes"
                                                             if failed else "") + f" (rank {rank}: {waits.now()})")
    print(f"probe micro-batch {micro}: {text}", flush=True)
    probefile.note(where, text)
    os._exit(probefile.RETRY_EXIT if failed else probefile.STUCK_EXIT)


def exit_within(where: Path, code: int, after: str, error: BaseException | None = None) -> None:
    """From here the process exits within EXIT_S whatever its teardown waits for (an engine's thread that
    a failed step left waiting, a process group's end), with `code`; the search is on disk already.
    `after`: what ended the probe, for the message; `error`: the one the worker reports."""
    seconds = waits.limit(EXIT_S)

    def expire() -> None:
        text = f"its processes had not exited {seconds:g} s after {after} ({waits.now()})"
        print(text, flush=True)
        probefile.note(where, text)
        if error is not None:
            write_error(error)  # where the worker's own report never came
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()

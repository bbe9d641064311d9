"""What bigfit's launcher and its workers (and any process of a job) agree on: the environment a
worker reads (the job's file, the start stamps), the error file a failing worker leaves, the cores a
process may use, and interrupts (Ctrl-C; SIGTERM made one; one that DCP wrapped). The launcher
itself, which starts and watches the workers, is commands/launch.py."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path

from ..errors import BigfitError

JOB_ENV = "BIGFIT_JOB_FILE"  # the job its launcher resolved and wrote (job/resolution.py), which its workers run
STARTED_ENV, LAUNCHED_ENV = "BIGFIT_STARTED_AT", "BIGFIT_LAUNCHED_AT"  # wall clocks: the time to the first step


def launched_job() -> str | None:
    """In a worker of bigfit's launcher: the path of the job it runs (None elsewhere, e.g. under torchrun)."""
    return os.environ.get(JOB_ENV)


def write_error(exc: BaseException) -> None:
    """Called by a failing worker: leave its error for the launcher (when there is one)."""
    path = os.environ.get("BIGFIT_ERROR_FILE")
    if not path:
        return
    user = isinstance(exc, BigfitError)
    Path(path).write_text(json.dumps({
        "rank": int(os.environ.get("RANK", 0)), "time": time.time(), "user_error": user,
        "message": str(exc) if user else f"{type(exc).__name__}: {exc}",
        "traceback": "" if user else "".join(traceback.format_exception(exc))}))


@contextlib.contextmanager
def stop_on_sigterm():
    """While the block runs, SIGTERM (`kill PID`, `timeout`, a scheduler's stop) is Ctrl-C: the block's
    KeyboardInterrupt path stops the processes it started, which otherwise outlive it holding the GPU's
    memory (a `bigfit bench` row stopped by `timeout` kept an H100 busy into the next call's rows). The
    interrupt's args name the signal, so the message can say which."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return

    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def interrupt_name(e: KeyboardInterrupt) -> str:
    """"SIGTERM" for an interrupt that stop_on_sigterm raised, else "Ctrl-C"."""
    return e.args[0] if e.args else "Ctrl-C"


def interrupt_in(exc: BaseException) -> KeyboardInterrupt | None:
    """The interrupt `exc` is or carries, else None. torch.distributed.checkpoint catches every
    BaseException in its steps, Ctrl-C's too, and raises a CheckpointException holding each rank's
    (its `failures`: rank -> (exception, stack)): an interrupt while a checkpoint is saved or loaded
    would otherwise end as a traceback, or as a message about the checkpoint."""
    if isinstance(exc, KeyboardInterrupt):
        return exc
    return next((f[0] for f in getattr(exc, "failures", {}).values() if isinstance(f[0], KeyboardInterrupt)), None)


def stamp_start() -> None:
    """Before torch is imported: the command's start, for the first step's breakdown (training/metrics.py
    StartClock; a worker of bigfit's launcher keeps the launcher's stamp, any other process, such as
    torchrun's workers, is its own), and torch's allocators set as below unless the user chose:
    - the CPU's on 2 MB pages: the offload engine's host states are tens of GB, touched first at start;
      on 4 KB pages that is millions of page faults (8 GB of zeros: 3.5 s on 4 KB pages, 1.4 s on 2 MB
      ones, 2-core CPU);
    - CUDA's on expandable segments (torchtitan's default too): batches of varying lengths otherwise
      leave blocks reserved that no later request fits, and a micro-batch its probe confirmed can run
      out of memory in training (a T5-large at micro-batch 169 under zero2 on an H100 with 3.96 GiB
      reserved but unallocated, `bigfit bench`, 2026-12-05)."""
    if LAUNCHED_ENV not in os.environ:
        os.environ[STARTED_ENV] = repr(time.time())
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read by torch's allocator (c10 alloc_cpu) once
    if not any(k in os.environ for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):  # either is the user's
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # read at CUDA's first allocation


def allowed_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

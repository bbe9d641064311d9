"""The files that micro-batch auto's launcher (commands/autobatch.py) and its probe workers (training/probe.py)
share: the search (planning/sizes.py's ProbeSearch) with every outcome the workers agreed on, the exit
statuses a worker set ends with, the time by which rank 0 promised to end what it is doing (the
launcher waits no longer, `promise`) and a worker's note of what a step that passed its deadline
waited for (`note`). A worker set that ends with OOM_EXIT was trying the search's next size, which is
how the launcher learns that it failed."""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from ..errors import BigfitError
from ..planning.sizes import ProbeSearch

OOM_EXIT = 3  # a worker's exit status for out-of-memory
RETRY_EXIT = 4  # a probe worker could not finish a step after an in-process out-of-memory: try it in a new set
STUCK_EXIT = 5  # a probe step of a worker set that met no out-of-memory error did not end by its deadline
# out of memory as torch raises it from a library's own allocation, a plain RuntimeError: cuBLAS could
# not make its handle for the backward's thread on a full card (T5-large under zero3 at micro-batch 181
# on an H100, 2026-12-06); cuDNN's workspace likewise
LIBRARY_OOM = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDA error: out of memory")


def out_of_memory(e: BaseException | None) -> bool:
    """Whether `e` means the device ran out of memory (torch's own error, or a library's: LIBRARY_OOM),
    itself or as the cause it was raised from: an engine's thread hands its error to the training
    thread wrapped ("the offload engine's host step failed", from the OOM of a bucket's copy up: t5-3b
    under zero2-offload on a 24 GB cap, 2026-12-07). Not its context: an error raised while handling
    an OOM is another error."""
    import torch

    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and
                                                     any(m in str(e) for m in LIBRARY_OOM)):
            return True
        seen.add(id(e))
        e = e.__cause__
    return False


def exit_status(e: BaseException) -> int:
    """A failed worker's exit status: 2 for a user's mistake (as one process exits, cli.py), OOM_EXIT for
    out-of-memory, 1 otherwise."""
    return 2 if isinstance(e, BigfitError) else OOM_EXIT if out_of_memory(e) else 1


def path(output_dir: str) -> Path:
    return Path(output_dir) / "logs" / "probe" / "search.json"


def save(where: Path, search: ProbeSearch) -> None:
    """Atomically: a worker set may be stopped at any moment once one of its ranks has failed."""
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_suffix(".partial")
    tmp.write_text(json.dumps(search.to_json()))
    os.replace(tmp, where)


def load(where: Path) -> ProbeSearch:
    return ProbeSearch.from_json(json.loads(where.read_text()))


def promise(where: Path, seconds: float | None) -> None:
    """Rank 0: what it does now ends within `seconds` (None: no promise, the model is being built), or
    its own deadline ends the process; the launcher stops a worker set that overstays it (commands/autobatch.py)."""
    target = where.parent / "deadline.json"
    if seconds is None:
        target.unlink(missing_ok=True)
        return
    tmp = target.with_suffix(".partial")
    tmp.write_text(json.dumps({"until": time.time() + seconds}))
    os.replace(tmp, target)


def promised(where: Path) -> float | None:
    """The wall-clock time by which rank 0 promised to be done (None: no promise)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        return float(json.loads((where.parent / "deadline.json").read_text())["until"])
    return None


def note(where: Path, text: str) -> None:
    """What a worker waited for when a deadline of its own expired: the first rank's note is kept."""
    with contextlib.suppress(FileExistsError), open(where.parent / "waited.txt", "x") as f:
        f.write(text)


def take_note(where: Path) -> str | None:
    """The note a worker set left, removed (each set's own)."""
    found = where.parent / "waited.txt"
    with contextlib.suppress(OSError):
        text = found.read_text().strip()
        found.unlink()
        return text
    return None

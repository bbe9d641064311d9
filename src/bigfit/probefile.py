"""The file that micro-batch auto's launcher (autobatch.py) and its probe workers (training/probe.py)
share: the search (planning/sizes.py's ProbeSearch) with every outcome the workers agreed on, and
the exit statuses a worker set ends with. A worker set that ends with OOM_EXIT was trying the
search's next size, which is how the launcher learns that it failed."""
from __future__ import annotations

import json
import os
from pathlib import Path

from .planning.sizes import ProbeSearch

OOM_EXIT = 3  # a worker's exit status for out-of-memory
RETRY_EXIT = 4  # a probe worker could not finish a step after an in-process out-of-memory: try it in a new set
# out of memory as torch raises it from a library's own allocation, a plain RuntimeError: cuBLAS could
# not make its handle for the backward's thread on a full card (T5-large under zero3 at micro-batch 181
# on an H100, 2026-12-06); cuDNN's workspace likewise
LIBRARY_OOM = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDA error: out of memory")


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` means the device ran out of memory (torch's own error, or a library's: LIBRARY_OOM)."""
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in LIBRARY_OOM))


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

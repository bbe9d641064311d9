"""Sizes as people write them (24GB, 512MiB, 1TB) and BIGFIT_GPU_MEMORY: pure, below everything
that reads them (machine/hardware.py's descriptions, distributed.py's allocator cap), so neither imports
the other."""
from __future__ import annotations

import os
import re

from ..errors import BigfitError

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, what: str = "size") -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m or m.group(2) not in UNITS:
        raise BigfitError(f"{what} {text!r} is not a size; write it like 24GB, 512MiB or 1TB")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def gpu_cap() -> int | None:
    """BIGFIT_GPU_MEMORY (e.g. 24GB): each GPU is this big for bigfit, detected and allocated alike,
    to plan and train as on a smaller card (a benchmark's 24 GB card on an H200, a GPU shared with
    another job). The runtime caps torch's allocator to it (distributed.init_runtime)."""
    text = os.environ.get("BIGFIT_GPU_MEMORY")
    if not text:
        return None
    cap = parse_size(text, "BIGFIT_GPU_MEMORY")
    if cap <= 0:
        raise BigfitError(f"BIGFIT_GPU_MEMORY {text!r} holds nothing; give each GPU's memory, like 24GB")
    return cap

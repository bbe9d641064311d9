"""The NVMe tier of zero2-offload-nvme: fp32 master weights and Adam's two moments in files on a fast
local disk, mapped into memory. One file per offload bucket (a block, see buckets.py) and kind. The
host optimizer steps bucket by bucket and asks the kernel to read the next bucket ahead (posix_fadvise WILLNEED) while the current one updates; dirty pages are written
back by the kernel asynchronously. Host RAM then holds the gradient buffers and a few buckets' worth
of pages, so optimizer states larger than the RAM still train."""
from __future__ import annotations

import os
from pathlib import Path

import torch

KINDS = ("master", "exp_avg", "exp_avg_sq")


class NVMeStore:
    """`sizes`: the offload engine's buckets' per-rank sizes; views[kind][bucket] is a flat fp32
    tensor backed by that bucket's file of that kind."""

    def __init__(self, directory: str | Path, sizes: list[int]):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.views: dict[str, list[torch.Tensor]] = {k: [] for k in KINDS}
        self.files: list[list[Path]] = []
        for b, size in enumerate(sizes):
            paths = [self.dir / f"bucket-{b:04d}-{kind}.bin" for kind in KINDS]
            self.files.append(paths)
            for kind, path in zip(KINDS, paths):
                path.unlink(missing_ok=True)  # a fresh, zero-filled file
                self.views[kind].append(torch.from_file(str(path), shared=True, size=size, dtype=torch.float32))

    def prefetch(self, bucket: int) -> None:
        """Start reading a bucket's files into the page cache; returns at once."""
        if bucket >= len(self.files) or not hasattr(os, "posix_fadvise"):
            return
        for path in self.files[bucket]:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def nbytes(self) -> int:
        return sum(p.stat().st_size for paths in self.files for p in paths)

"""The NVMe tier of zero2-offload-nvme: fp32 master weights and Adam's two moments in files on a fast
local disk, mapped into memory. One file per bucket (~256 MB of parameters) and kind; each parameter's
state is a view into its bucket. The host optimizer steps bucket by bucket and asks the kernel to read
the next bucket ahead (posix_fadvise WILLNEED) while the current one updates; dirty pages are written
back by the kernel asynchronously. Host RAM then holds the gradient buffers and a few buckets' worth
of pages, so optimizer states larger than the RAM still train."""
from __future__ import annotations

import os
from pathlib import Path

import torch

KINDS = ("master", "exp_avg", "exp_avg_sq")


class NVMeStore:
    def __init__(self, directory: str | Path, numels: list[int], bucket_numel: int = 64 << 20):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.buckets: list[list[int]] = [[]]
        size = 0
        for i, n in enumerate(numels):
            if self.buckets[-1] and size + n > bucket_numel:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += n
        self.views: dict[str, list[torch.Tensor | None]] = {k: [None] * len(numels) for k in KINDS}
        self.files: list[list[Path]] = []
        for b, members in enumerate(self.buckets):
            total = sum(numels[i] for i in members)
            paths = [self.dir / f"bucket-{b:04d}-{kind}.bin" for kind in KINDS]
            self.files.append(paths)
            for kind, path in zip(KINDS, paths):
                path.unlink(missing_ok=True)  # a fresh, zero-filled file
                flat = torch.from_file(str(path), shared=True, size=total, dtype=torch.float32)
                offset = 0
                for i in members:
                    self.views[kind][i] = flat[offset:offset + numels[i]]
                    offset += numels[i]

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

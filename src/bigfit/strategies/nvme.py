"""The NVMe tier of zero2-offload-nvme: fp32 master weights and Adam's two moments in files on a fast
local disk, mapped into memory. One file per offload bucket (a block, see buckets.py) and kind. The
host optimizer steps bucket by bucket and asks the kernel to read the next bucket ahead
(posix_fadvise WILLNEED) while the current one updates; the kernel writes dirty pages back
asynchronously. Host RAM then holds the gradient buffers (or slots, gradslots.py) and a few
buckets' worth of pages, so optimizer states larger than the RAM still train. `host_bytes` keeps
the first buckets' states (in forward order) in host RAM instead, as long as they fit in it: only
the rest streams from the disk each step (DeepSpeed's NVMe offload is all or nothing)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

KINDS = ("master", "exp_avg", "exp_avg_sq")


def on_disk(sizes: list[int], host_bytes: float) -> list[int]:
    """The buckets whose states go to files: all but the first ones whose 12 bytes per element fit
    in `host_bytes`."""
    kept, total = 0, 0
    for size in sizes:
        if total + 12 * size > host_bytes:
            break
        total, kept = total + 12 * size, kept + 1
    return list(range(kept, len(sizes)))


class NVMeStore:
    """`sizes`: the offload engine's buckets' per-rank sizes. views[kind][bucket] is a flat fp32
    tensor backed by that bucket's file of that kind, for the buckets in `on_disk(sizes, host_bytes)`."""

    def __init__(self, directory: str | Path, sizes: list[int], host_bytes: float = 0):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.views: dict[str, dict[int, torch.Tensor]] = {k: {} for k in KINDS}
        self.files: dict[int, list[Path]] = {}
        for b in on_disk(sizes, host_bytes):
            paths = [self.dir / f"bucket-{b:04d}-{kind}.bin" for kind in KINDS]
            self.files[b] = paths
            for kind, path in zip(KINDS, paths):
                path.unlink(missing_ok=True)  # a fresh, zero-filled file
                self.views[kind][b] = torch.from_file(str(path), shared=True, size=sizes[b], dtype=torch.float32)

    def holds(self, bucket: int) -> bool:
        return bucket in self.files

    def prefetch(self, bucket: int) -> None:
        """Start reading a bucket's files into the page cache; returns at once."""
        if bucket not in self.files or not hasattr(os, "posix_fadvise"):
            return
        for path in self.files[bucket]:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def nbytes(self) -> int:
        return sum(p.stat().st_size for paths in self.files.values() for p in paths)

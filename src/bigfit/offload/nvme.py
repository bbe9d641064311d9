"""The NVMe tier of zero2-offload-nvme: fp32 master weights and Adam's two moments (in the format of
--optimizer-states, statefmt.py) in files on a fast local disk, mapped into memory. One file per
offload bucket (a block, see buckets.py) and kind. The
host optimizer steps bucket by bucket and asks the kernel to read the next bucket ahead
(posix_fadvise WILLNEED) while the current one updates; the kernel writes dirty pages back
asynchronously. Host RAM then holds the gradient buffers (or slots, gradslots.py) and a few
buckets' worth of pages, so optimizer states larger than the RAM still train. `host_bytes` keeps
the first buckets' states (in forward order) in host RAM instead, as long as they fit in it: only
the rest streams from the disk each step (DeepSpeed's NVMe offload is all or nothing)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..common import faults
from ..errors import BigfitError


def on_disk(sizes: list[int], host_bytes: float, per_element: float = 12.0) -> list[int]:
    """The buckets whose states go to files: all but the first ones whose `per_element` bytes per
    element (master weights and moments: 12 in fp32, statefmt.bytes_per_parameter) fit in `host_bytes`."""
    kept, total = 0, 0.0
    for size in sizes:
        if total + per_element * size > host_bytes:
            break
        total, kept = total + per_element * size, kept + 1
    return list(range(kept, len(sizes)))


class NVMeStore:
    """`sizes`: the offload engine's buckets' per-rank sizes. `tensor` gives a bucket's state of a kind
    (master, exp_avg, ...) as a flat tensor backed by a file of its own, for the buckets in
    `on_disk(sizes, host_bytes, per_element)`."""

    def __init__(self, directory: str | Path, sizes: list[int], host_bytes: float = 0, per_element: float = 12.0):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files: dict[int, list[Path]] = {b: [] for b in on_disk(sizes, host_bytes, per_element)}
        self._check_room(per_element * sum(sizes[b] for b in self.files), host_bytes)

    def _check_room(self, mine: float, host_bytes: float) -> None:
        """The files are made sparse and filled as the states are written: a disk that cannot hold
        them all ends the job in SIGBUS mid-step (a 21.9B's states on a 64 GB disk, 2026-12-05). So
        this node's ranks' bytes (one directory each on the same disk) are checked up front."""
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        # an earlier run's files are made anew: the blocks they hold come free
        replaced = sum(p.stat().st_blocks * 512 for p in self.dir.glob("bucket-*.bin"))
        free = shutil.disk_usage(self.dir).free + replaced
        if mine * ranks > free:
            raise BigfitError(
                f"--nvme-host-gb {host_bytes * ranks / 1e9:g}: zero2-offload-nvme would keep {mine * ranks / 1e9:.1f} GB "
                f"of optimizer states in files under {self.dir.parent}, whose disk has {free / 1e9:.1f} GB free; keep "
                f"{(mine * ranks - free) / 1e9:.1f} GB more in host RAM (--nvme-host-gb), choose a compact "
                f"--optimizer-states (bf16, int8), or point --nvme-dir at a larger disk")

    def tensor(self, bucket: int, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        path = self.dir / f"bucket-{bucket:04d}-{kind}.bin"
        path.unlink(missing_ok=True)  # a fresh, zero-filled file
        self.files[bucket].append(path)
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)

    def holds(self, bucket: int) -> bool:
        return bucket in self.files

    def prefetch(self, bucket: int) -> None:
        """Start reading a bucket's files into the page cache; returns at once."""
        if bucket not in self.files:
            return
        faults.at("nvme-read")
        if not hasattr(os, "posix_fadvise"):
            return
        for path in self.files[bucket]:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def nbytes(self) -> int:
        return sum(p.stat().st_size for paths in self.files.values() for p in paths)

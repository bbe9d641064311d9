"""What the checkpoint manifest costs: a DCP save of a model's checkpoint-sized state (fp32 weights and
Adam's two moments, 12 bytes a parameter), then the manifest's checksums of the files it wrote
(train/manifest.describe, as every save does), then their verification (first_problem, as every
--resume and consolidate does), from the page cache and, where the process may drop it, from disk.

    python benchmarks/checkpoint_manifest.py --params 100e6 --dir /tmp/ckpt-bench [--repeat 3]

Prints one table row per size; the figures go to benchmarks/RESULTS.md with the machine and date.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from bigfit.outputs import manifest


def state(params: int) -> dict:
    """12 bytes a parameter, in tensors of 4M elements (a block's matrices are about that size)."""
    n, out = params // (4 << 20), {}
    for i in range(n):
        out[f"model.w{i}"] = torch.randn(4 << 20)
        out[f"optim.state.w{i}.exp_avg"] = torch.randn(4 << 20)
        out[f"optim.state.w{i}.exp_avg_sq"] = torch.rand(4 << 20)
    return out


def drop_caches() -> bool:
    """Empty the page cache (root only), so that verification reads from the disk as after a reboot."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--dir", default="/tmp/bigfit-ckpt-bench")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: the intent
    root = Path(args.dir)
    sd = state(int(args.params))
    gb = sum(t.numel() * 4 for t in sd.values()) / 1e9
    print("| checkpoint GB | DCP save s | manifest s | GB/s | verify (cached) s | verify (disk) s | cores |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for _ in range(args.repeat):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        save = timed(lambda: dcp.save(sd, checkpoint_id=str(root), no_dist=True))
        names = manifest.file_list(root, "COMPLETE")
        files = {}
        crc = timed(lambda: files.update(manifest.describe(root, names)))
        cached = timed(lambda: manifest.first_problem(root, files))
        disk = timed(lambda: manifest.first_problem(root, files)) if drop_caches() else float("nan")
        print(f"| {gb:.2f} | {save:.2f} | {crc:.2f} | {gb / crc:.2f} | {cached:.2f} | {disk:.2f} | {os.cpu_count()} |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

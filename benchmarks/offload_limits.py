"""The machine's limits that bound an offloaded step: pinned PCIe bandwidth each way, the
host's memory bandwidth, the CPU Adam rates (torch's fused AdamW with and without the engine's
grad_scale, bigfit's kernel with fp32 and bf16 gradients), and the local disk's write and read
bandwidth (for the NVMe tier).

  python benchmarks/offload_limits.py [--gib 2] [--disk-dir /tmp] --out limits.json
Each figure is the median of 5 runs after one warm-up. The disk read is measured after fsync and
posix_fadvise(DONTNEED), so it comes from the device, not the page cache (where the kernel honours it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _median(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pcie(gib: float) -> dict:
    n = int(gib * 2**30 / 4)
    host = torch.empty(n, dtype=torch.float32).pin_memory()
    dev = torch.empty(n, dtype=torch.float32, device="cuda")

    def down():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    def up():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    return {"d2h_gb_s": round(n * 4 / _median(down) / 1e9, 1), "h2d_gb_s": round(n * 4 / _median(up) / 1e9, 1)}


def memory_bandwidth(numel: int) -> dict:
    """GB/s of bytes read plus written: a copy (read 4, write 4 per value) and an add (read 8, write 4)."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    copy = _median(lambda: c.copy_(a))
    add = _median(lambda: torch.add(a, b, out=c))
    return {"host_copy_gb_s": round(8 * numel / copy / 1e9, 1), "host_add_gb_s": round(12 * numel / add / 1e9, 1)}


def cpu_adam(numel: int) -> dict:
    """G parameters/s of one flat step. torch's fused AdamW with a grad_scale (as the offload engine
    calls it) also writes the unscaled gradient back: 32 bytes a parameter against 28 without."""
    from bigfit.kernels import cpu_adam as kernel

    p = torch.zeros(numel)
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    out = {"threads": torch.get_num_threads()}
    out["cpu_adamw_gparams_s"] = round(numel / _median(opt.step) / 1e9, 2)
    opt.grad_scale = torch.tensor(1.0)
    out["cpu_adamw_scaled_gparams_s"] = round(numel / _median(opt.step) / 1e9, 2)
    if kernel.kernel() is not None:
        for dtype, key in ((torch.float32, "kernel_fp32_gparams_s"), (torch.bfloat16, "kernel_bf16_gparams_s")):
            g = p.grad.to(dtype)
            out[key] = round(numel / _median(lambda: kernel.step(opt, p, g, 1.0)) / 1e9, 2)
    return out


def disk(directory: str, gib: float) -> dict:
    path = os.path.join(directory, "bigfit-disk-probe.bin")
    data = os.urandom(64 << 20) * int(gib * 16)
    size = len(data)

    def write():
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def read():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while os.read(fd, 64 << 20):
                pass
        finally:
            os.close(fd)
    try:
        return {"disk_write_gb_s": round(size / _median(write, 3) / 1e9, 2),
                "disk_read_gb_s": round(size / _median(read, 3) / 1e9, 2), "disk_dir": directory}
    finally:
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--adam-numel", type=int, default=256 << 20)
    ap.add_argument("--disk-dir", default="/tmp")
    ap.add_argument("--out")
    a = ap.parse_args()
    r = {"cores": os.cpu_count(), "torch": torch.__version__}
    if torch.cuda.is_available():
        r.update(pcie(a.gib), gpu=torch.cuda.get_device_name())
    r.update(memory_bandwidth(a.adam_numel))
    r.update(cpu_adam(a.adam_numel))
    r.update(disk(a.disk_dir, a.gib))
    print(json.dumps(r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f)


if __name__ == "__main__":
    main()

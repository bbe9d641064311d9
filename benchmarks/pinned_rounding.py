"""Does torch's pinned-memory allocator round each pinned tensor up to a power of two, and does
registering plain memory (cudaHostRegister) give exactly-sized pinned memory with the same copy
speed? The offload engine pins each bucket's master and gradient buffer (docs/planning.md).

  python benchmarks/pinned_rounding.py
"""
import json
import time

import torch


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    out = {"torch": torch.__version__}
    for numel in (100_700_000, 394_000_000):  # a 3.6B block's master, the embedding's (fp32)
        before = rss()
        t = torch.zeros(numel, dtype=torch.float32, pin_memory=True)
        out[f"pin_memory {numel * 4 / 2**20:.0f} MiB: RSS grew MiB"] = round((rss() - before) / 2**20)
        stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
        out[f"pin_memory {numel * 4 / 2**20:.0f} MiB: host allocator reserved MiB"] = round(
            stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0)) / 2**20)
        del t
    numel = 100_700_000
    before = rss()
    plain = torch.zeros(numel, dtype=torch.float32)
    err = torch.cuda.cudart().cudaHostRegister(plain.data_ptr(), plain.numel() * 4, 0)
    out["registered: RSS grew MiB"] = round((rss() - before) / 2**20)
    out["registered: error code, is_pinned"] = [int(err), plain.is_pinned()]
    dev = torch.empty(numel, device="cuda")
    for name, host in (("registered", plain), ("pin_memory", torch.zeros(numel).pin_memory())):
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dev.copy_(host, non_blocking=True)
        issued = time.perf_counter() - t0
        torch.cuda.synchronize()
        out[f"{name}: H2D GB/s, issue ms"] = [round(5 * numel * 4 / (time.perf_counter() - t0) / 1e9, 1),
                                             round(issued * 1e3, 2)]
    torch.cuda.cudart().cudaHostUnregister(plain.data_ptr())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

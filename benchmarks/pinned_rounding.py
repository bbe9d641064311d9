"""Does torch's pinned-memory allocator round each pinned tensor up to a power of two, and does
bigfit's registered memory (offload/pinned.py: plain pages, cudaHostRegister) pin exactly the size
asked with the same copy speed? The offload engine pins each bucket's master and gradient buffer.

  PYTHONPATH=src python benchmarks/pinned_rounding.py
Sizes: a 3.6B Llama block's fp32 master (100.7M values) and its embedding's (394M). Prints JSON: RSS
growth per allocation, torch's host allocator's reserved bytes, and host<->device copy speed and
issue time (an asynchronous copy issues in microseconds; a synchronous one takes the copy's time).
"""
import json
import time

import torch

from bigfit.offload.pinned import host_zeros


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def reserved_mib() -> int:
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    return round(stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0)) / 2**20)


def speeds(host: torch.Tensor, dev: torch.Tensor) -> dict:
    out = {"is_pinned": host.is_pinned()}
    for way, (dst, src) in {"H2D": (dev, host), "D2H": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        issued = time.perf_counter() - t0
        torch.cuda.synchronize()
        out[f"{way} GB/s"] = round(5 * host.nbytes / (time.perf_counter() - t0) / 1e9, 1)
        out[f"{way} issue ms"] = round(issued * 1e3, 2)
    return out


def main() -> None:
    torch.cuda.init()
    out = {"torch": torch.__version__}
    for numel in (100_700_000, 394_000_000):
        mib = f"{numel * 4 / 2**20:.0f} MiB"
        for name, make in (("torch pin_memory", lambda: torch.zeros(numel, pin_memory=True)),
                           ("bigfit registered", lambda: host_zeros(numel, pin=True))):
            before, held = rss(), reserved_mib()
            t = make()
            out[f"{name} {mib}: RSS grew MiB"] = round((rss() - before) / 2**20)
            out[f"{name} {mib}: torch host allocator reserved MiB"] = reserved_mib() - held
            if numel == 100_700_000:
                out[f"{name} {mib}: copies"] = speeds(t, torch.empty(numel, device="cuda"))
            del t
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

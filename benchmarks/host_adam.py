"""The offload engine's host Adam step per optimizer-state format (--optimizer-states), in G parameters a
second on this machine's cores, with bf16 gradients as the engine gives them under bf16 compute.

    python benchmarks/host_adam.py [--params 268435456] [--threads 2,16] [--json out.json]

Each format steps one bucket of Llama-like rows (4096 a row) through the engine's own call
(bigfit/offload/adamrate.py, which `bigfit plan --calibrate` runs at 32M parameters on every core), 2 untimed
steps then the median of 7; torch's fused AdamW (the engine's fallback without a C compiler) beside
them. The bytes a parameter each moves (planning/estimate.host_step_bytes) give the memory bandwidth
it reached.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from bigfit.kernels import cpu_adam  # noqa: E402
from bigfit.offload.adamrate import step_seconds  # noqa: E402
from bigfit.planning.estimate import host_step_bytes  # noqa: E402


def measure(fmt: str, params: int, threads: int, repeats: int = 7) -> dict:
    with _threads(threads):
        n, s = step_seconds(fmt, params, repeats)
    moved = 40 if fmt == "torch" else host_step_bytes(2, fmt)
    return {"format": fmt, "threads": threads, "params": n, "step_s": round(s, 5),
            "gparams_per_s": round(n / s / 1e9, 3), "bytes_per_param": moved,
            "gb_per_s": round(n * moved / s / 1e9, 1)}


class _threads:
    """torch's intra-op threads and the kernel's (cores_per_rank reads sched_getaffinity) at `n`."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.before, self.affinity = torch.get_num_threads(), os.sched_getaffinity(0)
        torch.set_num_threads(self.n)
        os.sched_setaffinity(0, sorted(self.affinity)[:self.n])

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)
        os.sched_setaffinity(0, self.affinity)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=1 << 26)
    ap.add_argument("--threads", default=str(len(os.sched_getaffinity(0))))
    ap.add_argument("--json")
    args = ap.parse_args()
    if cpu_adam.kernel() is None:
        sys.exit("no C compiler built bigfit's kernel here: nothing to measure but torch's step")
    rows = [measure(fmt, args.params, int(t)) for t in args.threads.split(",")
            for fmt in ("torch", "fp32", "bf16", "int8")]
    print(f"{'format':8} {'threads':>7} {'G params/s':>10} {'vs fp32':>8} {'bytes/param':>11} {'GB/s':>6}")
    for r in rows:
        base = next(x for x in rows if x["format"] == "fp32" and x["threads"] == r["threads"])
        r["vs_fp32"] = round(r["gparams_per_s"] / base["gparams_per_s"], 2)
        print(f"{r['format']:8} {r['threads']:>7} {r['gparams_per_s']:>10.3f} {r['vs_fp32']:>8.2f} "
              f"{r['bytes_per_param']:>11.0f} {r['gb_per_s']:>6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

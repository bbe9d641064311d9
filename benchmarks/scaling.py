"""Throughput per GPU of bigfit's data-parallel strategies and of the peers on 1..N GPUs of
one host, each case under torchrun in its own processes, peers in the same call.

  python benchmarks/scaling.py --gpus 1,2 --size 3b --mbs 4 --seq 2048 --out $OUT/scaling.jsonl
Needs .whl/peers.py (../shared/bench/peers.py, carried) and, for DeepSpeed rows, its wheels
installed as benchmarks/gpu_offload.sh does. peers.py pins its process to GPU 0, so each peer rank
runs through `rank` below, which first narrows CUDA_VISIBLE_DEVICES to its own GPU. Scaling
efficiency = tokens/s per GPU at N / tokens/s per GPU at 1.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

BIGFIT = ("ddp", "zero1", "zero2", "zero3")
PEERS = ("fsdp2", "ds-z2", "ds-z3")
HERE = os.path.dirname(os.path.abspath(__file__))


def _torchrun(n: int, script: list[str], timeout: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *script]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {e.timeout} s"}
    lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
    return json.loads(lines[0][7:]) if lines else {"error": out[-400:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="all")  # "rank": one peer rank (internal)
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--size", default="3b")
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--method")
    ap.add_argument("--methods", default=",".join(BIGFIT + PEERS))
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--out")
    a = ap.parse_args()
    common = ["--size", a.size, "--mbs", str(a.mbs), "--seq", str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    if a.mode == "rank":  # one peer rank, on its own GPU
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")  # this job's GPUs, in order
        local = int(os.environ["LOCAL_RANK"])
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[local] if visible != [""] else str(local)
        os.environ["LOCAL_RANK"] = "0"  # DeepSpeed picks cuda:LOCAL_RANK among the visible ones
        sys.argv = ["peers.py", a.method, *common]
        sys.path.insert(0, os.path.join(HERE, "..", ".whl"))
        import peers
        peers.main() if os.environ["RANK"] == "0" else _quiet(peers.main)
        return
    base = {}
    for n in map(int, a.gpus.split(",")):
        for m in a.methods.split(","):
            script = [os.path.join(HERE, "strategies.py"), "one", m, *common] if m.split("+")[0] in BIGFIT else \
                [__file__, "rank", "--method", m, *common]
            r = {"method": m, "gpus": n, **_torchrun(n, script, a.timeout)}
            if "tok_s" in r:
                if n == 1:
                    base[m] = r["tok_s"]
                r["efficiency"] = round(r["tok_s"] / base[m], 3) if m in base else None
            print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")


def _quiet(fn) -> None:
    with open(os.devnull, "w") as null:
        sys.stdout = null
        fn()


if __name__ == "__main__":
    main()

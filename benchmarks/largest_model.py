"""The capacity target: the largest Llama-shaped model that a method fully fine-tunes (AdamW, bf16,
2 steps of 1 x 2048 tokens with activation checkpointing; --steps, --warmup) on this machine, bigfit's
offload engine against DeepSpeed's ZeRO-2/3 offload (../shared/bench/peers.py, carried in .whl/).

  python benchmarks/largest_model.py --layers 32,48,64 --methods zero2-offload,ds-z2-offload,ds-z3-offload
Each (method, size) runs in its own process with a timeout; a size fits when its steps finish (an
out-of-memory error, a kill by the kernel's OOM killer or the timeout count as not fitting).
bigfit methods take strategies.py's variants: `zero2-offload+devgrads` (gradients wait on the GPU:
12 bytes of host RAM per parameter), `zero2-offload-nvme+devgrads` (BIGFIT_NVME_HOST_GB of states in
RAM, the rest in files under BIGFIT_NVME_DIR, emptied before each attempt). Sizes
are hidden 4096 / 32 heads / 8 KV heads / 14336 MLP / vocabulary 128256 (8B at 32 layers), by layers.
Prints one JSON line per attempt (the median step and each timed step) and the largest size that
fitted per method. A disk tier's first steps write its files and run fast; its steady state needs
a warm-up: `--layers 45 --methods zero2-offload-nvme+devgrads --warmup 10 --steps 6`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from strategies import nvme_tier  # this folder is on the path: the script runs from it

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = (4096, None, 32, 8, 14336, 128256)  # hidden, layers, heads, kv heads, MLP, vocabulary

ATTEMPT = """
import json, sys
sys.path[:0] = [{here!r}, {whl!r}]
shape = {shape!r}
if {bigfit!r}:
    import strategies as m
    m.SIZES["probe"] = shape
    r = m.run_one({method!r}, "probe", 1, {seq}, {steps}, {warmup}, 1, True)
else:
    import peers as m
    m.SIZES["probe"] = shape
    r = m.run_one({method!r}, "probe", 1, {seq}, {steps}, {warmup}, True)
r.pop("trace", None)
print("RESULT " + json.dumps(r), flush=True)
"""


def attempt(method: str, layers: int, timeout: int, tiny: bool = False, steps: int = 2, warmup: int = 0) -> dict:
    base = (64, None, 4, 2, 128, 384) if tiny else SHAPE  # --tiny: this script's smoke test on a CPU
    shape = (base[0], layers, *base[2:])
    code = ATTEMPT.format(here=HERE, whl=os.path.join(HERE, "..", ".whl"), shape=shape, method=method,
                          seq=64 if tiny else 2048, steps=steps, warmup=warmup,
                          bigfit=not method.startswith(("ds-", "fsdp", "torch")))
    shutil.rmtree(nvme_tier()[0], ignore_errors=True)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"method": method, "layers": layers, "fits": False, "why": f"timeout {timeout} s"}
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    r = json.loads(lines[-1][7:]) if lines else {}
    fits = p.returncode == 0 and "error" not in r and bool(r)
    why = r.get("error") or (f"exit {p.returncode}" + (" (killed: out of host memory?)" if p.returncode < 0 else "")
                             if not fits else None)
    return {"method": method, "layers": layers, "fits": fits, "why": why, **{k: r.get(k) for k in
            ("params_b", "step_s", "step_times", "peak_alloc_gib", "host_rss_gib")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="32,48,64")
    ap.add_argument("--methods", default="zero2-offload,ds-z2-offload,ds-z3-offload")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--steps", type=int, default=2, help="timed steps; the step time is their median")
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps before them (a disk tier's files fill)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    best = {}
    for method in a.methods.split(","):
        for layers in sorted(map(int, a.layers.split(","))):
            r = attempt(method, layers, a.timeout, a.tiny, a.steps, a.warmup)
            print(json.dumps(r), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
            if not r["fits"]:
                break  # larger ones will not fit either
            best[method] = (layers, r["params_b"])
    print("largest that fitted:", json.dumps(best))


if __name__ == "__main__":
    main()

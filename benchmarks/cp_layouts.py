"""Context-parallel throughput through `bigfit train` itself: a Llama-3-8B shape (config only, random
init, bf16) at 32K, 64K and 128K tokens a sample, --cp 1, 2, 4, 8 under each FSDP2 strategy (zero2,
zero3, zero3-offload) or ddp, one process per GPU (--nproc = --gpus). The data-parallel degree is
GPUs / cp and each data-parallel rank trains one sample a step (global batch GPUs / cp, micro-batch 1),
so every row moves the same tokens per GPU. Each row is a `bigfit train` run of its own with a time
limit (benchmarks/longseq.py's runner: a hung row's process group is stopped); tokens/s: the median of
metrics.jsonl's steps after the first; peak: rank 0's peak_gpu_gb. Model TFLOP/s per GPU: 6 x
non-embedding parameters + 12 x layers x hidden x sequence a token (layouts.py's count).

NOT RUN YET: it needs several GPUs, and none were lent when it was written. To run it (8 GPUs):
  run(command="PYTHONPATH=$PWD/src python3 benchmarks/cp_layouts.py --gpus 8 --out $OUT/cp", kind="nvidia-h100-x8")
  (--seqs 32768,65536,131072 --cps 1,2,4,8 --strategies zero3 by default; add zero2,zero3-offload,ddp for
  more rows, --budget to stay inside one call: rows still to run are written as skipped)
CPU check (gloo, 2 processes):
  .venv/bin/python benchmarks/cp_layouts.py --gpus 2 --shape tiny --seqs 256 --cps 1,2 --steps 2 --out /tmp/cp

Writes OUT/cp_layouts.jsonl (a row per run as it comes, failures with their reason) and OUT/cp_layouts.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from longseq import SHAPES, bigfit_row  # noqa: E402


def flops_per_token(shape: str, seq: int) -> float:
    h, layers, heads, kv, inter, _ = SHAPES[shape]
    per_layer = 2 * h * h * (1 + kv / heads) + 3 * h * inter  # q, o, k, v (GQA) and the gated MLP
    return 6 * layers * per_layer + 12 * layers * h * seq


def one(a, strategy: str, cp: int, seq: int) -> dict:
    """One run: --strategy STRATEGY --cp CP at SEQ tokens a sample (no --cp flag at 1: the plain run)."""
    row = {"strategy": strategy, "cp": cp, "dp": a.gpus // cp, "seq": seq, "gpus": a.gpus}
    left = a.deadline - time.time()
    if left < 60:
        return {**row, "ok": False, "error": "skipped: the budget is spent"}
    a.strategy = strategy
    extra = ["--cp", str(cp)] if cp > 1 else []
    r = bigfit_row(a, seq, min(a.timeout, left), nproc=a.gpus, batch=a.gpus // cp, extra=extra,
                   name=f"{a.shape}-{strategy}-cp{cp}-{seq}")
    row.update(r)
    if r.get("ok"):
        per_gpu = r["tokens_per_s"] / a.gpus
        row.update(tokens_per_s_per_gpu=round(per_gpu, 1),
                   tflops_per_gpu=round(per_gpu * flops_per_token(a.shape, seq) / 1e12, 2))
    return row


def table(rows: list[dict]) -> str:
    lines = ["| seq | strategy | cp x dp | tokens/s per GPU | model TFLOP/s per GPU | peak GB | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        note = r.get("error") or r.get("plan", "")[:70]
        lines.append(f"| {r['seq']:,} | {r['strategy']} | {r['cp']} x {r['dp']} | {r.get('tokens_per_s_per_gpu') or ''} | "
                     f"{r.get('tflops_per_gpu') or ''} | {r.get('peak_gb') or ''} | {note} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=8, help="processes, one per GPU (on a CPU: gloo ranks)")
    p.add_argument("--shape", default="8b", choices=SHAPES)
    p.add_argument("--seqs", default="32768,65536,131072")
    p.add_argument("--cps", default="1,2,4,8", help="context-parallel degrees (those dividing --gpus run)")
    p.add_argument("--strategies", default="zero3", help="zero2, zero3, zero3-offload, ddp")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps a run (the first not timed)")
    p.add_argument("--precision", default=None, help="--precision; default: bigfit's (bf16 on GPUs)")
    p.add_argument("--bigfit-args", default="", help="more bigfit train flags, e.g. '--activations checkpoint'")
    p.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    p.add_argument("--budget", type=float, default=1e9, help="seconds for all runs")
    p.add_argument("--out", default="cp-out")
    a = p.parse_args()
    out = Path(a.out)
    a.work, a.logs, a.mode, a.deadline = out / "work", out / "logs", "full", time.time() + a.budget
    a.logs.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(out / "cp_layouts.jsonl", "a") as f:
        for seq in map(int, a.seqs.split(",")):
            for strategy in a.strategies.split(","):
                for cp in (int(c) for c in a.cps.split(",") if a.gpus % int(c) == 0):
                    rows.append(one(a, strategy, cp, seq))
                    f.write(json.dumps(rows[-1]) + "\n")
                    f.flush()
                    print(json.dumps(rows[-1]), flush=True)
    (out / "cp_layouts.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()

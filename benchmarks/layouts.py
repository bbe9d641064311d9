"""Throughput of composed layouts through `bigfit train` itself: FSDP2 alone against tensor
parallelism, FSDP2 x TP, HSDP, pipeline x data parallel and 3D, and a torchtitan-style row (FSDP2 x
TP with per-block activation checkpointing and torch.compile, torchtitan's Llama defaults), all at
the same global batch on the same GPUs. Each row is one `bigfit train` run of its own (bigfit's
launcher, one process per GPU); its tokens/s are the median of the steps after the warm-up, read
from metrics.jsonl. Model TFLOP/s and MFU per GPU use 6 x non-embedding parameters + 12 x layers x
hidden x sequence per token (DESIGN.md) against --peak-tflops.

  python benchmarks/layouts.py --gpus 8 --size 8b --batch 32 --mbs 4 --seq 2048 --out $OUT/layouts
  python benchmarks/layouts.py --gpus 2 --size tiny --seq 64 --layouts zero3,tp2 --steps 3   # CPU check

Writes OUT/layouts.jsonl (a row per layout, failures with their reason), OUT/layouts.md and
OUT/layouts.png (tokens/s per GPU, MFU annotated).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name: bigfit train flags (the degree a strategy fills takes the rest of the GPUs)
LAYOUTS = {
    "zero3": ["--strategy", "zero3"],
    "ddp": ["--strategy", "ddp"],
    "hsdp": ["--strategy", "zero3", "--dp-replicate", "2"],
    "tp2": ["--strategy", "zero3", "--tp", "2"],
    "tp4": ["--strategy", "zero3", "--tp", "4"],
    "tp8": ["--strategy", "zero3", "--tp", "8"],
    "pp2": ["--strategy", "zero3", "--pp", "2", "--pipeline-schedule", "1f1b"],
    "pp2-ddp": ["--strategy", "ddp", "--pp", "2", "--pipeline-schedule", "1f1b"],
    "3d": ["--strategy", "zero3", "--pp", "2", "--tp", "2", "--pipeline-schedule", "1f1b"],
    "torchtitan": ["--strategy", "zero3", "--tp", "2", "--activation-checkpointing", "--compile"],
}
# hidden, layers, heads, kv heads, intermediate, vocab (Llama-shaped)
SIZES = {"tiny": (64, 4, 4, 4, 128, 384), "1b": (2048, 16, 32, 8, 8192, 128256),
         "8b": (4096, 32, 32, 8, 14336, 128256), "13b": (5120, 40, 40, 8, 13824, 128256)}


def write_inputs(root: Path, size: str, seq: int, samples: int) -> tuple[Path, Path, float]:
    """A config-only Llama directory, a text file of `samples` lines, and the model FLOPs per token."""
    from transformers import LlamaConfig

    h, layers, heads, kv, inter, vocab = SIZES[size]
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=inter, vocab_size=vocab, max_position_embeddings=max(seq, 256),
                      tie_word_embeddings=False)
    cfg.save_pretrained(root / "model")
    line = ("the quick brown fox jumps over the lazy dog " * (seq // 8 + 1))[: seq - 2]  # ~seq bytes: ~seq tokens
    (root / "data.txt").write_text("".join(f"{i} {line}\n" for i in range(samples)))
    per_layer = 4 * h * h * (1 + kv / heads) / 2 + 3 * h * inter  # q, o, k, v (GQA) and the gated MLP
    return root / "model", root / "data.txt", 6 * layers * per_layer + 12 * layers * h * seq


def run(name: str, a, model: Path, data: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "bigfit", "train", "--model", str(model), "--data", str(data), *LAYOUTS[name],
           "--nproc", str(a.gpus), "--precision", a.precision, "--batch-size", str(a.batch),
           "--micro-batch-size", str(a.mbs), "--max-source-len", str(a.seq), "--max-steps", str(a.warmup + a.steps),
           "--eval-every", "0", "--eval-samples", "0", "--save-every", "0", "--no-consolidate", "--lr", "1e-4",
           "--overwrite", "--output-dir", str(out / name)]  # this benchmark's own runs: replaced each time
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"layout": name, "error": f"timed out after {a.timeout} s"}
    if p.returncode:
        return {"layout": name, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    tok_s = statistics.median(r["tokens_per_s"] for r in rows[a.warmup:])
    cells = [x.split("│") for x in p.stdout.splitlines() if x.count("│") >= 3]  # the start table's rows
    plan = next((c[2].strip() for c in cells if c[1].strip() == "plan"), "")
    return {"layout": name, "tokens_per_s": round(tok_s), "tokens_per_s_per_gpu": round(tok_s / a.gpus),
            "wall_s": round(time.perf_counter() - t0, 1), "plan": plan, "loss": rows[-1]["loss"]}


def report(rows: list[dict], flops: float, a, out: Path) -> None:
    lines = ["| layout | tokens/s | per GPU | model TFLOP/s per GPU | MFU | note |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | | | | | {r['error']} |")
            continue
        tflops = flops * r["tokens_per_s_per_gpu"] / 1e12
        r.update(tflops_per_gpu=round(tflops, 1), mfu=round(tflops / a.peak_tflops, 3))
        lines.append(f"| {r['layout']} | {r['tokens_per_s']:,} | {r['tokens_per_s_per_gpu']:,} | {tflops:.1f} | "
                     f"{r['mfu']:.1%} | {r['plan'][:60]} |")
    (out / "layouts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    good = [r for r in rows if "error" not in r]
    if good:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(good)), 3.5))
        bars = ax.bar([r["layout"] for r in good], [r["tokens_per_s_per_gpu"] for r in good], color="#4c72b0")
        for bar, r in zip(bars, good):
            ax.annotate(f"{r['mfu']:.0%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)
        ax.set_ylabel("tokens/s per GPU")
        ax.set_title(f"{a.size}, {a.gpus} GPUs, batch {a.batch} x {a.seq} (MFU on bars)")
        fig.tight_layout()
        fig.savefig(out / "layouts.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8, help="processes (one per GPU; on a CPU machine: gloo ranks)")
    ap.add_argument("--size", default="8b", choices=SIZES)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--batch", type=int, default=32, help="global batch, equal for every layout")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch per data-parallel rank")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200 SXM: 989)")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default="layouts-out")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, data, flops = write_inputs(out, a.size, a.seq, samples=max(4 * a.batch, 64))
    rows = []
    with open(out / "layouts.jsonl", "w") as f:
        for name in a.layouts.split(","):
            rows.append(run(name, a, model, data, out))
            f.write(json.dumps(rows[-1]) + "\n")
            f.flush()
            print(json.dumps(rows[-1]), flush=True)
    report(rows, flops, a, out)


if __name__ == "__main__":
    main()

"""Does training with compact optimizer states (--optimizer-states bf16 | int8) converge as with fp32?

    python benchmarks/state_convergence.py [--steps 2000] [--hidden 128] [--layers 4] [--out DIR] [--plot PNG]

The same small Llama-style model (built from a config: RoPE, grouped-query attention), seed, data and
schedule, trained through `bigfit train --strategy zero2-offload` once per format (one process; on a
GPU machine pass --precision bf16 and a larger --hidden). The data is running text that every
machine has: this Python's standard library sources, byte by byte, the first `--corpus-mb` MB of
them in sorted order (the embedded task is learnt to a loss near 1e-4 in 1,500 steps, where 1% says
nothing). Prints each run's final loss (the mean of the last 100 steps) against fp32's, writes every
run's metrics.jsonl under OUT and the curves to PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

FORMATS = ("fp32", "bf16", "int8")


def model_dir(root: Path, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig

    out = root / f"llama-h{hidden}-l{layers}"
    LlamaConfig(vocab_size=384, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                num_attention_heads=max(2, hidden // 32), num_key_value_heads=max(1, hidden // 64),
                max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                bos_token_id=1).save_pretrained(out)
    return out


def corpus(root: Path, mb: float) -> Path:
    """Running text: the standard library's .py files in sorted order, up to `mb` MB."""
    out, budget, parts = root / "corpus.txt", int(mb * 1e6), []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text[:budget - sum(map(len, parts))])
        if sum(map(len, parts)) >= budget:
            break
    out.write_text("".join(parts), encoding="utf-8")
    return out


def train(model: Path, data: Path, out: Path, fmt: str, args) -> float:
    cmd = [sys.executable, "-m", "bigfit", "train", "--model", str(model), "--data", str(data),
           "--output-dir", str(out), "--overwrite", "--max-source-len", str(args.seq),
           "--strategy", "zero2-offload", "--nproc", "1", "--optimizer-states", fmt, "--max-steps", str(args.steps),
           "--batch-size", str(args.batch), "--lr", str(args.lr), "--warmup-steps", "100", "--lr-schedule", "cosine",
           "--precision", args.precision, "--seed", "0", "--eval-every", "0", "--no-eval-on-start",
           "--no-checkpoints", "--eval-samples", "64"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return time.perf_counter() - t0


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def plot(curves: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (whole, tail) = plt.subplots(1, 2, figsize=(11, 4))
    for fmt, ys in curves.items():
        smooth = [statistics.mean(ys[max(0, i - 24):i + 1]) for i in range(len(ys))]  # 25-step running mean
        whole.plot(range(1, len(ys) + 1), smooth, label=fmt, lw=1)
        start = len(ys) // 2
        tail.plot(range(start + 1, len(ys) + 1), smooth[start:], label=fmt, lw=1)
    whole.set(xlabel="step", ylabel="training loss (25-step mean)", yscale="log", title=title)
    tail.set(xlabel="step", title="second half")
    whole.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--corpus-mb", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--out", default="/tmp/state-convergence")
    ap.add_argument("--plot", default="docs/optimizer_states.png")
    args = ap.parse_args()
    root = Path(args.out)
    model = model_dir(root, args.hidden, args.layers)
    data = corpus(root, args.corpus_mb)
    curves, rows = {}, []
    for fmt in FORMATS:
        seconds = train(model, data, root / fmt, fmt, args)
        curves[fmt] = losses(root / fmt)
        final = statistics.mean(curves[fmt][-100:])
        held_out = json.loads((root / fmt / "eval.jsonl").read_text().splitlines()[-1])["eval_loss"]
        rows.append({"format": fmt, "steps": len(curves[fmt]), "final_loss": round(final, 5),
                     "eval_loss": round(held_out, 5), "wall_s": round(seconds, 1)})
        print(f"{fmt}: {len(curves[fmt])} steps in {seconds:.0f} s, final loss (last 100 steps) {final:.5f}, "
              f"held-out {held_out:.5f}", flush=True)
        (root / "summary.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))  # a run cut short keeps it
    base = rows[0]
    for r in rows:
        r["vs_fp32"] = round(r["final_loss"] / base["final_loss"] - 1, 5)
        r["eval_vs_fp32"] = round(r["eval_loss"] / base["eval_loss"] - 1, 5)
        print(f"{r['format']:5} final loss {r['final_loss']:.5f} ({100 * r['vs_fp32']:+.2f}% against fp32), "
              f"held-out {r['eval_loss']:.5f} ({100 * r['eval_vs_fp32']:+.2f}%)")
    (root / "summary.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(curves, Path(args.plot), f"Llama h{args.hidden} x {args.layers}, {args.steps} steps, {args.precision}")
    print(f"wrote {args.plot} and {root / 'summary.json'}")


if __name__ == "__main__":
    main()

"""`bigfit train --pack` against the same data unpacked: instruction pairs of uneven length (a prompt
and an answer of 20-600 bytes each, as chat fine-tuning data is), a config-only Llama, bf16. Each row is
`bigfit train` itself; the figures are the median after the warm-up of target tokens per second
(the answer tokens that carry loss: what training learns from), tokens the GPU processed per step and
peak GPU memory, from metrics.jsonl.

  python benchmarks/packing.py --size 1b --seq 2048 --batch 8 --steps 12 --out rows.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import string
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from strategies import SIZES  # noqa: E402


def write_inputs(root: Path, size: str, pairs: int = 4000) -> tuple[Path, Path]:
    from transformers import LlamaConfig

    h, layers, heads, kv, inter, vocab = SIZES[size]
    model = root / f"model-{size}"
    if not (model / "config.json").exists():
        LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                    intermediate_size=inter, vocab_size=max(vocab, 384), max_position_embeddings=8192,
                    tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=1).save_pretrained(model)
    rng = random.Random(0)

    def text(lo, hi):
        return "".join(rng.choice(string.ascii_letters + " ") for _ in range(rng.randint(lo, hi)))

    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": text(20, 600), "completion": text(20, 600)}) + "\n"
                            for _ in range(pairs)))
    return model, data


def row(model: Path, data: Path, out: Path, pack: bool, seq: int, batch: int, steps: int, warmup: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-m", "bigfit", "train", "--model", str(model), "--data", str(data), "--strategy", "single",
            "--precision", "bf16", "--batch-size", str(batch), "--max-steps", str(steps), "--max-source-len", str(seq),
            "--max-target-len", str(seq), "--eval-samples", "0", "--no-checkpoints", "--lr", "1e-4",
            "--output-dir", str(out)] + (["--pack"] if pack else [])
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        return {"pack": pack, "error": done.stderr[-1500:]}
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    after = records[warmup:]
    step = statistics.median(r["tokens"] / r["tokens_per_s"] for r in after)
    return {"pack": pack, "seq": seq, "batch": batch, "steps": len(records),
            "target_tok_s": round(statistics.median(r["tokens_per_s"] for r in after)),
            "target_tokens_per_step": round(statistics.mean(r["tokens"] for r in after)), "step_s": round(step, 4),
            "peak_gpu_gb": max((r.get("peak_gpu_gb") or 0) for r in records) or None,
            "losses": [round(r["loss"], 4) for r in records]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1b", choices=sorted(SIZES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--work", default="/tmp/bigfit-packing")
    ap.add_argument("--out", help="append each row (JSON) here")
    a = ap.parse_args()
    root = Path(a.work)
    root.mkdir(parents=True, exist_ok=True)
    model, data = write_inputs(root, a.size)
    for pack in (False, True):
        r = {"size": a.size, **row(model, data, root / f"run-{pack}", pack, a.seq, a.batch, a.steps, a.warmup)}
        print(json.dumps(r), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()

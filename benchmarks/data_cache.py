"""Tokenizing and starting on a large text corpus with 2 ranks: `--data-cache off` (every process
tokenizes the whole corpus into Python lists: the launcher's check, then each worker) against the node's
cache (one process tokenizes into an Arrow file, the workers map it). Wall time from launch to the first
step, and the peak RSS of every process of the run (VmHWM, read from /proc while it lives).

The corpus: JSONL documents of words drawn from a Zipf-like vocabulary, the size asked for; the model:
a small Llama config with a byte-level BPE tokenizer trained here on the corpus's first megabytes
(a fast tokenizer, as real models have: bigfit's fallback byte tokenizer is pure Python).

  python benchmarks/data_cache.py --gb 0.2 --cache off --out rows.jsonl
  python benchmarks/data_cache.py --gb 2 --cache on --out rows.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path


def write_corpus(path: Path, gb: float, seed: int = 0) -> Path:
    if path.exists() and path.stat().st_size >= gb * 1e9:
        return path
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(20000)]
    weights = [1 / (i + 1) for i in range(len(words))]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        written = 0
        while written < gb * 1e9:
            doc = " ".join(rng.choices(words, weights, k=rng.randint(50, 1500)))
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            written += len(line)
    tmp.rename(path)
    return path


def write_model(root: Path, corpus: Path) -> Path:
    """A 2-block Llama config and a 16k byte-level BPE tokenizer trained on the corpus's first 20 MB."""
    model = root / "model"
    if (model / "tokenizer.json").exists():
        return model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with open(corpus) as f:
        sample = [json.loads(line)["text"] for _, line in zip(range(20000), f)]
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=16000, special_tokens=["<pad>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(model)
    LlamaConfig(vocab_size=16000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=1, pad_token_id=0,
                bos_token_id=1).save_pretrained(model)
    return model


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for t in os.listdir(f"/proc/{p}/task") for c in
                     open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            pass
    return out


def peak_kb(pid: int, launcher: int) -> tuple[str, int] | None:
    """(what the process is: launcher, rank N or a tokenizing helper; its peak RSS in KiB)."""
    try:
        status = open(f"/proc/{pid}/status").read()
        cmd = open(f"/proc/{pid}/cmdline").read()
        env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
    except OSError:
        return None
    if "python" not in cmd:
        return None
    role = "launcher" if pid == launcher else f"rank {env['RANK']}" if "RANK" in env else "tokenizing helper"
    hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")), 0)
    return role, hwm


def run(model: Path, corpus: Path, cache: str, out: Path, seq: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    argv = [sys.executable, "-m", "bigfit", "train", "--model", str(model), "--data", str(corpus), "--nproc", "2",
            "--strategy", "ddp", "--max-steps", "3", "--batch-size", "8", "--max-source-len", str(seq),
            "--eval-samples", "0", "--no-checkpoints", "--output-dir", str(out),
            "--data-cache", cache if cache != "on" else str(out.parent / "cache")]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(out.parent / f"{out.name}.err", "w"))
    peaks: dict[int, tuple[str, int]] = {}
    first = None
    while proc.poll() is None:
        for p in tree(proc.pid):
            if (seen := peak_kb(p, proc.pid)) is not None:
                peaks[p] = seen
        if first is None and (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip():
            first = time.perf_counter() - t0
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"bigfit train failed ({proc.returncode}): {(out.parent / f'{out.name}.err').read_text()[-2000:]}")
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return {"cache": cache, "corpus_gb": round(corpus.stat().st_size / 1e9, 3), "seq": seq, "wall_s": round(wall, 1),
            "first_step_s": first and round(first, 1), "startup_s": record.get("startup_s"),
            "peak_rss_gib": sorted([role, round(kb / 2**20, 2)] for role, kb in peaks.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--cache", choices=("off", "on"), default="on")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--root", default="/tmp/bigfit-data-cache-bench")
    ap.add_argument("--out", help="append the row (JSON) here")
    a = ap.parse_args()
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(root / f"corpus-{a.gb:g}gb.jsonl", a.gb)
    model = write_model(root, corpus)
    shutil.rmtree(root / "cache", ignore_errors=True)  # a cold start: the cache is built
    row = run(model, corpus, a.cache, root / f"run-{a.cache}", a.seq)
    print(json.dumps(row))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

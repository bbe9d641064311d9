"""The longest sequence one GPU trains, and its tokens/s: `bigfit train` against plain Hugging Face with
gradient checkpointing (benchmarks/longseq_plain.py), on Llama-3 shapes from their configs (random init).
Every length runs in a child process of its own with a time limit (an out-of-memory error, a hang or a
host OOM ends only the child); a JSON row per length is appended to --out as it comes:
{method, shape, mode, seq, ok, tokens_per_s, peak_gb, error, ...}.

  bigfit  `python3 -m bigfit train` on one sample of exactly SEQ tokens a step (a text file's blocks of
          --max-source-len tokens: a config-only model reads it byte-level), --batch-size 1, --strategy
          auto (or --strategy), --no-checkpoints; tokens/s: the median of metrics.jsonl's steps after the
          first; peak: its peak_gpu_gb (host_rss_gb on a CPU). The start table's plan and prediction kept.
  plain   longseq_plain.py's loop (full: AdamW; lora: peft; qlora: bitsandbytes NF4 + peft).

--search: doubling from --seq while a length fits, then bisecting between the last fit and the first
failure over the ladder 2^k and 1.5 x 2^k (8K, 12K, 16K, 24K, 32K, 48K, ...); a first failure halves
down to --min-seq. A time-out stops the climb (longer would take longer still). The search's row names
the longest; a bigfit search adds `bigfit plan --max-seq-len`'s prediction beside it (its error, where
the flag is not there).

  python3 benchmarks/longseq.py --shape 8b --mode full --method bigfit --seq 32768 --out $OUT/longseq.jsonl
  python3 benchmarks/longseq.py --shape 8b --mode full --method bigfit --search --seq 65536 --budget 400 ...
  .venv/bin/python benchmarks/longseq.py --shape tiny --method plain --seq 256 --out /tmp/x.jsonl   (CPU)
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

# hidden, layers, heads, kv heads, intermediate, vocab (Llama-3-8B and -70B; tiny for the CPU check: its
# matrices whole NF4 blocks, for --load-in-4bit)
SHAPES = {"tiny": (128, 2, 4, 4, 256, 512), "8b": (4096, 32, 32, 8, 14336, 128256),
          "70b": (8192, 80, 64, 8, 28672, 128256)}
MAX_POSITIONS = 1 << 20  # RoPE needs no table: a limit above every length tried
ROW_MARK = "LONGSEQ-ROW "


def config_of(shape: str):
    from transformers import LlamaConfig

    h, layers, heads, kv, inter, vocab = SHAPES[shape]
    return LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       intermediate_size=inter, vocab_size=vocab, rope_theta=500000.0,
                       max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False)


def model_dir(root: Path, shape: str) -> Path:
    """A config-only model directory (bigfit: random init; its tokenizer byte-level)."""
    model = root / f"model-{shape}"
    if not (model / "config.json").is_file():
        config_of(shape).save_pretrained(model)
    return model


def data_file(root: Path, seq: int, samples: int) -> Path:
    """A text file of `samples` + 1 lines of SEQ bytes: bigfit cuts running text into blocks of exactly
    --max-source-len tokens (one byte a token), so each sample is SEQ tokens long."""
    line = ("the quick brown fox jumps over the lazy dog " * (seq // 44 + 1))[:seq]
    data = root / f"data-{seq}.txt"
    data.write_text((line + "\n") * (samples + 1))
    return data


def run_child(cmd: list[str], log: Path, timeout: float) -> tuple[int | None, str]:
    """`cmd` in a session of its own, output into `log`; past `timeout` its whole process group is
    stopped (SIGTERM, then SIGKILL), so a launcher's workers go too. (exit status or None, log tail)."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = None
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
                try:
                    os.killpg(p.pid, sig)
                    p.wait(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
    return rc, log.read_text(errors="replace")[-20000:]


def failure(rc: int | None, tail: str, timeout: float) -> str:
    """One line for a child that did not finish: time-out, out of memory, killed, or its last line."""
    if rc is None:
        return f"timed out after {timeout:.0f} s"
    last = next((x.strip() for x in reversed(tail.splitlines()) if x.strip()), f"exit status {rc}")[:300]
    low = tail.lower()
    if "out of memory" in low or "outofmemoryerror" in low:
        return "OOM: " + last
    return f"killed by signal {-rc} (host out of memory?)" if rc < 0 else last


def start_table(text: str) -> dict:
    """The plan and prediction rows of bigfit's start table, their wrapped lines joined."""
    rows, key = {}, None
    for line in text.splitlines():
        cells = line.split("│")
        if len(cells) >= 4:
            key = cells[1].strip() or key
            if key in ("plan", "prediction"):
                rows[key] = (rows.get(key, "") + " " + cells[2].strip()).strip()
    return rows


def bigfit_cmd(a, model: Path, data: Path, seq: int, out: Path, nproc: int = 1, batch: int = 1,
               extra: list[str] = ()) -> list[str]:
    """`bigfit train` at SEQ tokens a sample, micro-batch 1, BATCH samples a step, no checkpoint saved."""
    cmd = [sys.executable, "-m", "bigfit", "train", "--model", str(model), "--data", str(data),
           "--strategy", a.strategy, "--nproc", str(nproc), "--batch-size", str(batch), "--micro-batch-size", "1",
           "--max-source-len", str(seq), "--max-steps", str(a.steps), "--eval-every", "0", "--eval-samples", "0",
           "--no-checkpoints", "--lr", "1e-5", "--overwrite", "--output-dir", str(out), *extra]
    cmd += ["--precision", a.precision] if a.precision else []
    cmd += ["--lora", "--lora-r", "16"] if a.mode in ("lora", "qlora") else []
    cmd += ["--load-in-4bit"] if a.mode == "qlora" else []
    return cmd + shlex.split(a.bigfit_args)


def read_run(run: Path, steps: int) -> dict:
    """tokens/s (median after the first step) and the peaks of a finished run's metrics.jsonl."""
    path = run / "metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    if len(recs) < steps:
        return {"ok": False, "error": f"{len(recs)} of {steps} steps in metrics.jsonl"}
    gpu, host = recs[-1].get("peak_gpu_gb"), recs[-1].get("host_rss_gb")
    return {"ok": True, "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in recs[1:] or recs), 1),
            "peak_gb": host if gpu is None else gpu, "peak_of": "host" if gpu is None else "gpu", "host_gb": host,
            "loss": round(recs[-1]["loss"], 4)}


def bigfit_row(a, seq: int, timeout: float, nproc: int = 1, batch: int = 1, extra: list[str] = (),
               name: str = "") -> dict:
    """One `bigfit train` run at SEQ tokens a sample, read back from its metrics.jsonl."""
    model, data = model_dir(a.work, a.shape), data_file(a.work, seq, samples=a.steps * batch)
    name = name or f"{a.shape}-{a.mode}-{seq}"
    cmd = bigfit_cmd(a, model, data, seq, a.work / f"run-{name}", nproc, batch, extra)
    rc, tail = run_child(cmd, a.logs / f"bigfit-{name}.log", timeout)
    r = read_run(a.work / f"run-{name}", a.steps) if rc == 0 else {"ok": False, "error": failure(rc, tail, timeout)}
    data.unlink(missing_ok=True)
    return {**r, **start_table(tail)}


def plain_row(a, seq: int, timeout: float) -> dict:
    """One plain row in a child process (this script with --child): its row from its last marked line."""
    cmd = [sys.executable, __file__, "--child", "--method", "plain", "--shape", a.shape, "--mode", a.mode,
           "--seq", str(seq), "--steps", str(a.steps)]
    rc, tail = run_child(cmd, a.logs / f"plain-{a.shape}-{a.mode}-{seq}.log", timeout)
    marked = [x for x in tail.splitlines() if x.startswith(ROW_MARK)]
    return json.loads(marked[-1][len(ROW_MARK):]) if marked else {"ok": False, "error": failure(rc, tail, timeout)}


def measure(a, seq: int) -> dict:
    """A row for SEQ, written to --out as it comes; its child's time limit is within the budget."""
    left = a.deadline - time.time()
    timeout, t0 = min(a.timeout, left), time.time()
    if left < 30:
        r = {"ok": False, "error": "skipped: the budget is spent"}
    else:
        r = (bigfit_row if a.method == "bigfit" else plain_row)(a, seq, timeout)
    row = {"method": a.method, "shape": a.shape, "mode": a.mode, "seq": seq, "ok": False, "tokens_per_s": None,
           "peak_gb": None, "error": None, **r, "wall_s": round(time.time() - t0, 1)}
    return emit(a, row)


def emit(a, row: dict) -> dict:
    print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def ladder(lo: int, hi: int) -> list[int]:
    """Powers of 2 and 1.5 x them, from `lo` to `hi`."""
    pts = {p * m for k in range(4, 25) for p, m in ((1 << k, 1), (1 << k, 1.5))}
    return sorted(int(x) for x in pts if lo <= x <= hi)


def search(a) -> dict:
    """Double from --seq while it fits (or halve while it does not), then bisect over the ladder."""
    steps_ = ladder(min(a.min_seq, a.seq), a.max_seq)
    if a.seq not in steps_:
        steps_ = sorted({*steps_, a.seq})
    tried: dict[int, str] = {}

    def fits(n: int) -> bool:
        r = measure(a, n)
        tried[n] = "ok" if r["ok"] else r["error"]
        return r["ok"]

    def stopped() -> str | None:  # a time-out or a spent budget: longer lengths would not finish either
        return next((e for e in tried.values() if e.startswith(("timed out", "skipped"))), None)

    if fits(a.seq):
        good = a.seq
        while 2 * good in steps_ and fits(2 * good):
            good *= 2
        bad = 2 * good if 2 * good in steps_ else a.max_seq + 1  # past the cap: the ladder's points up to it
    else:
        bad = a.seq
        while bad // 2 in steps_ and not fits(bad // 2):
            bad //= 2
        good = bad // 2 if tried.get(bad // 2) == "ok" else None
    while good and bad and not stopped():
        between = [n for n in steps_ if good < n < bad]
        if not between:
            break
        mid = between[len(between) // 2]
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    stop = stopped()
    return emit(a, {"method": a.method, "shape": a.shape, "mode": a.mode, "search": True, "longest": good,
                    "first_failure": bad if bad and bad <= a.max_seq else None, "stopped": stop, "tried": {str(k): v for k, v in sorted(tried.items())}})


def card_mib() -> int | None:
    """The GPU's memory in MiB as nvidia-smi says (no CUDA context in this process), else None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def predicted(plan: dict) -> dict:
    """Per strategy (and composed layout): the longest predicted, how activations are kept there, its
    tokens/s, or why none fits; and the longest of all."""
    rows = {e["name"]: {"max_seq_len": e.get("max_seq_len"), "activations": (e.get("row") or {}).get("activations"),
                        "tokens_per_s": round((e.get("row") or {}).get("tokens_per_s") or 0, 1),
                        "beyond": (e.get("beyond") or "")[:160]}
            for e in [*plan.get("strategies", []), *plan.get("composed", [])]}
    fit = [k for k in rows if rows[k]["max_seq_len"]]
    best = max(fit, key=lambda k: rows[k]["max_seq_len"], default=None)
    return {"best": best, "best_max_seq_len": rows[best]["max_seq_len"] if best else None, "rows": rows}


def plan_row(a, measured: int | None) -> dict:
    """`bigfit plan --max-seq-len` for this shape and mode on one GPU of this card (this host's RAM),
    beside the longest measured."""
    mib = card_mib()
    gpus = f"1x{mib}MiB" if mib else f"1x{a.card_gb}GB"
    cmd = [sys.executable, "-m", "bigfit", "plan", "--model", str(model_dir(a.work, a.shape)), "--gpus", gpus,
           "--max-seq-len", "--json", "--batch-size", "1"]
    cmd += ["--precision", a.precision] if a.precision else []
    cmd += ["--lora", "--lora-r", "16"] if a.mode in ("lora", "qlora") else []
    cmd += ["--load-in-4bit"] if a.mode == "qlora" else []
    row = {"method": "bigfit-plan", "shape": a.shape, "mode": a.mode, "gpus": gpus, "measured_longest": measured,
           "error": None}
    timeout = min(600, max(60, a.deadline - time.time()))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        row.update(predicted(json.loads(p.stdout)))
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError):  # the flag absent, or its output changed
        row["error"] = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["?"])[-1][:300]
    except subprocess.TimeoutExpired:
        row["error"] = f"bigfit plan timed out after {timeout:.0f} s"
    return emit(a, row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=("bigfit", "plain"), default="bigfit")
    p.add_argument("--shape", choices=SHAPES, default="8b")
    p.add_argument("--mode", choices=("full", "lora", "qlora"), default="full")
    p.add_argument("--seq", type=int, default=32768, help="the length, or where --search starts")
    p.add_argument("--search", action="store_true")
    p.add_argument("--min-seq", type=int, default=1024, help="--search: the shortest tried")
    p.add_argument("--max-seq", type=int, default=1 << 20, help="--search: the longest tried")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps a length (the first not timed)")
    p.add_argument("--strategy", default="auto", help="bigfit's --strategy")
    p.add_argument("--precision", default=None, help="bigfit's --precision; default: bigfit's (bf16 on a GPU)")
    p.add_argument("--bigfit-args", default="", help="more bigfit train flags, e.g. '--activations offload'")
    p.add_argument("--timeout", type=float, default=600, help="seconds a length may take")
    p.add_argument("--budget", type=float, default=1e9, help="seconds for all lengths of this call")
    p.add_argument("--card-gb", type=int, default=80, help="bigfit plan's GPU size where nvidia-smi is absent")
    p.add_argument("--work", default="/tmp/bigfit-longseq", help="model, data and runs")
    p.add_argument("--out", default=None, help="JSONL the rows are appended to; logs in LOGS beside it")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:  # one plain length in this process
        sys.path.insert(0, str(Path(__file__).parent))
        from longseq_plain import row

        print(ROW_MARK + json.dumps(row(config_of(a.shape), a.mode, a.seq, a.steps)), flush=True)
        return
    a.work, a.deadline = Path(a.work), time.time() + a.budget
    a.work.mkdir(parents=True, exist_ok=True)
    a.logs = (Path(a.out).parent if a.out else a.work) / "longseq-logs"
    a.logs.mkdir(parents=True, exist_ok=True)
    if not a.search:
        measure(a, a.seq)
        return
    found = search(a)
    if a.method == "bigfit":
        plan_row(a, found["longest"])


if __name__ == "__main__":
    main()

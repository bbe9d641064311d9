"""`bigfit train` against benchmarks/strategies.py (the engine driven by a bare loop) on the same
shape, side by side in one process tree, and the time from launch to the first step.

Each row runs strategies.py's `one` mode (random tokens, sync around each step, median step time after
warm-up) and then `bigfit train` on a config-only Llama of the same shape with a text file whose lines
fill the sequence (no padding), reading the median step time from metrics.jsonl (target tokens over
tokens/s). The launch-to-first-step time is the wall time until metrics.jsonl gets its first line;
host RSS is the largest child's peak.

  python benchmarks/command_vs_engine.py --size 1b --seq 1024 --rows single,zero3,zero2-offload --out rows.jsonl
  python benchmarks/command_vs_engine.py --start-only --size 3b --rows zero2-offload   (time to first step)
  python benchmarks/command_vs_engine.py --rows zero3,zero3,zero3,zero3 --alternate   (rounds, the order alternated)
  BIGFIT_NVME_HOST_GB=12 python benchmarks/command_vs_engine.py --rows zero2-offload-nvme   (both sides keep 12 GB of
    optimizer states in RAM and the rest in BIGFIT_NVME_DIR, default /tmp/bigfit-nvme)
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from strategies import SIZES, nvme_tier  # noqa: E402


def write_inputs(root: Path, size: str, seq: int, weights: bool) -> Path:
    """The model directory (config only, or bf16 safetensors weights) and a text file of full lines."""
    from transformers import LlamaConfig

    h, layers, heads, kv, inter, vocab = SIZES[size]
    model = root / f"model-{size}{'-w' if weights else ''}"
    if not (model / "config.json").exists():
        config = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                             intermediate_size=inter, vocab_size=vocab, max_position_embeddings=8192,
                             tie_word_embeddings=False)
        if weights:
            save_bf16(config, model)
        else:
            config.save_pretrained(model)
    # random letters: a text the model cannot learn in a few steps (a repeated line's vanishing gradients
    # fill a CPU's AdamW moments with denormal floats, 25x slower: not what the engine rows see)
    rng = random.Random(0)
    lines = ("".join(rng.choice(string.ascii_letters + " ") for _ in range(seq + 16)) for _ in range(256))
    (root / "data.txt").write_text("".join(f"{x}\n" for x in lines))
    return model


def save_bf16(config, model: Path) -> None:
    """A bf16 checkpoint of random weights, one block at a time (no whole model in memory)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    model.mkdir(parents=True)
    config.save_pretrained(model)
    shards, index, part, size = [], {}, {}, 0
    for name, p in meta.state_dict().items():
        part[name] = (torch.randn(p.shape, dtype=torch.bfloat16) * 0.02).contiguous()
        size += part[name].nbytes
        if size > 4 * 2**30:
            shards.append(part)
            part, size = {}, 0
    shards.append(part)
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, model / fname, metadata={"format": "pt"})
        index.update({k: fname for k in tensors})
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def engine_row(variant: str, size: str, mbs: int, seq: int, steps: int) -> dict:
    cmd = [sys.executable, str(HERE / "strategies.py"), "one", variant, "--size", size, "--mbs", str(mbs),
           "--seq", str(seq), "--steps", str(steps), "--warmup", "3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"error": (p.stdout + p.stderr)[-3000:]}


def command_row(variant: str, model: Path, data: Path, mbs: int, seq: int, steps: int, out: Path) -> dict:
    strategy, *flags = variant.split("+")
    extra = (["--delayed-update"] * ("delayed" in flags)
             + ["--max-grad-norm", "0"] * ("noclip" in flags or "eager" in flags)
             + ["--offload-grads", "device"] * ("devgrads" in flags)
             + ["--activation-checkpointing"] * ("ckpt" in flags))
    if strategy == "zero2-offload-nvme":  # the disk tier as the engine row sets it
        where, host_gb = nvme_tier()
        extra += ["--nvme-dir", where, "--nvme-host-gb", str(host_gb)]
    cmd = [sys.executable, "-m", "bigfit", "train", "--model", str(model), "--data", str(data), "--strategy", strategy,
           "--nproc", "1", "--precision", "bf16", "--batch-size", str(mbs), "--max-source-len", str(seq),
           "--max-steps", str(steps), "--eval-every", "0", "--eval-samples", "0", "--save-every", "0",
           "--no-checkpoints", "--lr", "1e-4", "--warmup-steps", "0", "--output-dir", str(out), *extra]
    metrics = out / "metrics.jsonl"
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    while p.poll() is None:
        if first is None and metrics.exists() and metrics.read_text().strip():
            first = time.perf_counter() - start
        time.sleep(0.05)
    log = p.stdout.read()
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    if p.returncode or not rows:
        return {"error": log[-3000:], "exit": p.returncode}
    step_s = statistics.median(r["tokens"] / r["tokens_per_s"] for r in rows[3:]) if len(rows) > 3 else None
    return {"step_s": round(step_s, 4) if step_s else None, "first_step_s": round(first, 1),
            "startup_s": rows[0].get("startup_s"), "peak_gpu_gb": rows[-1].get("peak_gpu_gb"),
            "wall_s": round(time.perf_counter() - start, 1), "loss": rows[-1]["loss"],
            "host_rss_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1b")
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", default="single,zero3,zero2-offload,zero2-offload+delayed+noclip")
    ap.add_argument("--weights", action="store_true", help="bf16 safetensors weights instead of config only")
    ap.add_argument("--start-only", action="store_true", help="only bigfit train's time to the first step")
    ap.add_argument("--work", default="/tmp/cve")
    ap.add_argument("--out", default=None)
    ap.add_argument("--alternate", action="store_true", help="every second row runs bigfit train before the engine")
    a = ap.parse_args()
    root = Path(a.work)
    root.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model = write_inputs(root, a.size, a.seq, a.weights)
    print(f"inputs ready in {time.perf_counter() - t:.1f} s", flush=True)
    for i, variant in enumerate(a.rows.split(",")):
        row = {"variant": variant, "size": a.size, "mbs": a.mbs, "seq": a.seq, "weights": a.weights}
        first = "command" if a.alternate and i % 2 else "engine"  # alternated: neither always runs on a warm machine
        row["first"] = first
        if first == "command":
            c = _command(a, variant, model, root)
        if not a.start_only:
            e = engine_row(variant, a.size, a.mbs, a.seq, a.steps - 3)
            row["engine_step_s"], row["engine_error"] = e.get("step_s"), e.get("error")
        if first == "engine":
            c = _command(a, variant, model, root)
        row.update({f"command_{k}": v for k, v in c.items()})
        if row.get("engine_step_s") and c.get("step_s"):
            row["command_over_engine"] = round(c["step_s"] / row["engine_step_s"], 3)
        emit(row, a.out)


def _command(a, variant: str, model: Path, root: Path) -> dict:
    run = root / f"run-{variant}"
    subprocess.run(["rm", "-rf", str(run)])
    c = command_row(variant, model, root / "data.txt", a.mbs, a.seq, a.steps if not a.start_only else 2, run)
    subprocess.run(["rm", "-rf", str(run)])  # its final checkpoint: the next row needs the disk
    return c


def emit(row: dict, out: str | None) -> None:
    """A result row on stdout and, when asked, appended to the JSONL file `out` (kept if a later row fails)."""
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""LoRA fine-tuning through `bigfit train --lora` against what a user writes by hand: peft's
get_peft_model on the model in bf16 and a plain PyTorch loop, on the same shape and data, in one
process tree; with the planner's prediction for bigfit's pick.

The model is a config-only Llama of benchmarks/strategies.py's SIZES (random init), the data a text
file whose lines fill the sequence (command_vs_engine.py's). Both rows: LoRA r 16, alpha 32, dropout
0.05 on every linear layer but the head, AdamW lr 1e-4 over the adapters, no clipping in the peft
row (bigfit clips at 1.0: its default), bf16 weights. Step time: median after 3 warm-up steps;
peak GPU memory: torch's max_memory_allocated.

  python benchmarks/lora_vs_peft.py --size 8b --mbs 4 --seq 2048 --out rows.jsonl
  python benchmarks/lora_vs_peft.py --size tiny --mbs 2 --seq 64 --steps 5   (a smoke test on a CPU)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from command_vs_engine import emit, write_inputs  # noqa: E402

LORA = dict(r=16, alpha=32, dropout=0.05)


def peft_row(model_dir: Path, data: Path, mbs: int, seq: int, steps: int) -> dict:
    """The hand-written loop: from_config in bf16 on the device, get_peft_model, AdamW, no clipping."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from bigfit.models.source import load_tokenizer, locate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=device == "cuda")
    src = locate(str(model_dir))
    tok = load_tokenizer(src, config)
    lines = data.read_text().splitlines()
    ids = [tok(x, add_special_tokens=False)["input_ids"][:seq] for x in lines]
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        batch = torch.tensor(ids[(i * mbs) % len(ids):][:mbs], device=device)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[3:]) if len(times) > 3 else times[-1]
    return {"row": "peft + PyTorch", "step_s": round(step, 4), "tok_s": round(mbs * seq / step),
            "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if device == "cuda" else None,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad), "loss": round(loss.item(), 3)}


def bigfit_row(model_dir: Path, data: Path, mbs: int, seq: int, steps: int, strategy: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "bigfit", "train", "--model", str(model_dir), "--data", str(data), "--lora",
           "--lora-r", str(LORA["r"]), "--lora-alpha", str(LORA["alpha"]), "--lora-dropout", str(LORA["dropout"]),
           "--strategy", strategy, "--nproc", "1", "--precision", "bf16", "--batch-size", str(mbs),
           "--max-source-len", str(seq), "--max-steps", str(steps), "--eval-every", "0", "--eval-samples", "0",
           "--no-checkpoints", "--lr", "1e-4", "--warmup-steps", "0", "--lr-schedule", "constant",
           "--output-dir", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    log = p.stdout + p.stderr
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    if p.returncode or not rows:
        return {"row": f"bigfit {strategy}", "error": log[-3000:], "exit": p.returncode}
    step = statistics.median(r["tokens"] / r["tokens_per_s"] for r in rows[3:]) if len(rows) > 3 else None
    picked = next((x for x in log.splitlines() if x.startswith("--strategy auto ->")), None)
    return {"row": f"bigfit {strategy}", "step_s": round(step, 4) if step else None,
            "tok_s": round(mbs * seq / step) if step else None, "peak_gpu_gb": rows[-1].get("peak_gpu_gb"),
            "loss": round(rows[-1]["loss"], 3), "auto": picked}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8b")
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--strategies", default="auto")
    ap.add_argument("--work", default="/tmp/lvp")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    root = Path(a.work)
    root.mkdir(parents=True, exist_ok=True)
    model = write_inputs(root, a.size, a.seq, False)
    rows = [bigfit_row(model, root / "data.txt", a.mbs, a.seq, a.steps, s, root / f"run-{s}")
            for s in a.strategies.split(",")]
    rows.append(peft_row(model, root / "data.txt", a.mbs, a.seq, a.steps))
    for r in rows:
        emit({**r, "size": a.size, "mbs": a.mbs, "seq": a.seq}, a.out)


if __name__ == "__main__":
    main()

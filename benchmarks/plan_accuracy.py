"""How close `bigfit plan`'s per-GPU prediction comes to the measured peak: every (strategy, model
family, batch) case in its own process, on one GPU (torch.cuda.max_memory_allocated), or on a CPU
(growth of peak RSS; `--size tiny` is this script's smoke test there). Prints a markdown table with
the predicted parts (estimate.memory's peak moment) and, on a GPU, what was alive at the measured
peak (from the CUDA allocator's history, grouped by the code that allocated it).

  python benchmarks/plan_accuracy.py --size medium --precision bf16 --out $OUT/plan_accuracy.jsonl
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

# the allocating code (a Python frame's file:function) -> what the planner calls it; first match wins
KINDS = (("optim/", "optimizer"), ("_init_sharded_param", "params"), ("module.py:convert", "params"),
         ("offload.py", "params"), ("alloc_storage", "gathered"), ("all_gather", "gathered"),
         ("foreach_reduce", "reduce"), ("common/distributed.py:_pre_forward", "ddp buckets"), ("cross_entropy", "loss"),
         ("modeling_", "activations"))

STRATEGIES = ("single", "zero2", "zero3", "zero2-offload")
CASES = {"tiny": [("llama", 2, 64), ("llama", 4, 128), ("gpt2", 2, 64), ("gpt2", 4, 128)],
         "medium": [("llama", 2, 1024), ("llama", 8, 1024), ("gpt2", 2, 1024), ("gpt2", 8, 1024)]}


def config(family: str, size: str):
    from transformers import GPT2Config, LlamaConfig

    if size == "tiny":
        return (LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False) if family == "llama"
                else GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000))
    if family == "llama":  # ../shared/bench/peers.py's "1b"
        return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
    return GPT2Config(n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, n_positions=1024)  # GPT-2 large


def one(strategy: str, family: str, batch: int, seq: int, size: str, precision: str) -> dict:
    import torch

    from bigfit.common.distributed import init_runtime
    from bigfit.training.calibrate import measure
    from bigfit.parallel import plan_for

    rt = init_runtime(group_for_one=plan_for(strategy, 1).engine == "fsdp")
    gpu = rt.device.type == "cuda"
    if gpu:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    r = measure(config(family, size), strategy, batch, seq, precision, rt)
    if gpu:
        r["at_peak"] = at_peak(torch.cuda.memory._snapshot()["device_traces"][rt.device.index])
        torch.cuda.memory._record_memory_history(enabled=None)
    return {**r, "family": family, "size": size, "precision": precision, "device": rt.device.type}


def at_peak(trace: list[dict]) -> dict[str, int]:
    """Bytes alive at the allocator's peak, by kind; "other" is mostly autograd's own allocations
    (gradients, backward temporaries), which carry no Python frame."""
    live, now, best, kinds = {}, 0, (0, {}), {}
    for ev in trace:
        if ev["action"] == "alloc":
            frames = " ".join(f"{f['filename']}:{f['name']}" for f in ev.get("frames", []))
            key = next((kind for part, kind in KINDS if part in frames), "other")
            live[ev["addr"]] = (ev["size"], key)
            now += ev["size"]
            kinds[key] = kinds.get(key, 0) + ev["size"]
            if now > best[0]:
                best = (now, dict(kinds))
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            size, key = live.pop(ev["addr"])
            now -= size
            kinds[key] -= size
    return {k: v for k, v in best[1].items() if v}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="medium", choices=tuple(CASES))
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--one", nargs=4, metavar=("STRATEGY", "FAMILY", "BATCH", "SEQ"))
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.one:
        s, f, b, t = a.one
        print("RESULT " + json.dumps(one(s, f, int(b), int(t), a.size, a.precision), default=str), flush=True)
        return
    print("| strategy | model | batch x seq | predicted GB | measured GB | predicted / measured | predicted parts "
          "| alive at the measured peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for strategy in STRATEGIES:
        for family, batch, seq in CASES[a.size]:
            cmd = [sys.executable, __file__, "--size", a.size, "--precision", a.precision,
                   "--one", strategy, family, str(batch), str(seq)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if not lines:
                print(f"| {strategy} | {family} | {batch}x{seq} | failed: {(p.stderr or p.stdout)[-200:]!r} |")
                continue
            r = json.loads(lines[-1][7:])
            print(f"| {strategy} | {family} | {batch}x{seq} | {r['predicted'] / 1e9:.2f} | {r['measured'] / 1e9:.2f} "
                  f"| {r['ratio']:.3f} | {_gb(r['parts'])} | {_gb(r.get('at_peak', {}))} |", flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")


def _gb(parts: dict) -> str:
    return ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
                     if v and k != "total")


if __name__ == "__main__":
    main()

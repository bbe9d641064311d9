"""The host's cost of issuing an eager training step, per traced forward operator, and the forward's share
of it, on the planner's own operator counts (bigfit.commands.calibrate.measure, what `bigfit plan --calibrate`
runs): the calibration's small Llama, a 1.2B Llama's shape and T5-large's, at one short sample, where the
GPU waits for the host; `--compile 0,1` beside each block compiled as `bigfit train --compile` compiles
it (hostcost.COMPILED). One JSON line each.

  python benchmarks/host_issue.py --out $OUT/host_issue.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def configs(tiny: bool) -> dict:
    from transformers import LlamaConfig, T5Config

    from bigfit.commands.calibrate import CONFIG

    if tiny:  # this script's smoke test on a CPU
        return {"calibration-llama": None,
                "t5-tiny": T5Config(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=1,
                                    vocab_size=384, decoder_start_token_id=0, pad_token_id=0, use_cache=False)}
    return {"calibration-llama": LlamaConfig(**CONFIG),
            "llama-1.2b": LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      tie_word_embeddings=False),
            "t5-large": T5Config(d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24, num_decoder_layers=24,
                                 vocab_size=32128, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                 use_cache=False)}


def main() -> None:
    import torch

    from bigfit.commands.calibrate import measure

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--compile", default="0", help="0, 1 or 0,1: eager, each block compiled (as --compile), or both")
    ap.add_argument("--models", help="comma-separated names of those below (default: all)")
    ap.add_argument("--out")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name, config in configs(a.tiny).items():
        if a.models and name not in a.models.split(","):
            continue
        for compiled in (c == "1" for c in a.compile.split(",")):
            r = {"model": name, **measure(device, config, a.seq, a.steps, compiled)}
            print(json.dumps(r), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()

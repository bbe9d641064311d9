#!/usr/bin/env bash
# `bigfit train` with each strategy name on one GPU, at two source trees side by side in one call:
# the composable plan must cost nothing against the commit before it.
#   git archive 768844e src | tar -x -C old-src   (then carried: an untracked directory in the checkout)
#   bash benchmarks/same_speed.sh old-src/src src            (rows into $OUT/same_speed.jsonl as they come)
# A Llama-shaped 1.2B (config only, random init), bf16, micro-batch 4 x 1024, STEPS steps (default 6;
# the first 3 are warm-up); the two trees alternate per strategy so that drift on the machine hits both
# alike. STRATEGIES (default: every name that runs on one GPU) narrows the list.
set -u
old=$1; new=$2; out=${OUT:-/tmp/out}; w=/tmp/same-speed; mkdir -p "$out" "$w"
python3 - "$w" <<'PY'
import sys
from pathlib import Path
from transformers import LlamaConfig
root = Path(sys.argv[1])
LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
            intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
            tie_word_embeddings=False).save_pretrained(root / "model")
line = "the quick brown fox jumps over the lazy dog " * 24
(root / "data.txt").write_text("".join(f"{i} {line}\n" for i in range(512)))
PY
for strategy in ${STRATEGIES:-single zero2 zero3 zero2-offload zero3-offload device_map}; do
  for tree in "$old" "$new"; do
    rm -rf "$w/run"
    start=$(date +%s)
    PYTHONPATH=$PWD/$tree python3 -m bigfit train --model "$w/model" --data "$w/data.txt" --strategy "$strategy" \
      --nproc 1 --precision bf16 --batch-size 4 --max-source-len 1024 --max-steps ${STEPS:-6} --eval-every 0 --eval-samples 0 \
      --save-every 0 --no-consolidate --lr 1e-4 --output-dir "$w/run" > "$w/log" 2>&1
    code=$?
    python3 - "$w/run/metrics.jsonl" "$strategy" "$tree" "$code" "$(( $(date +%s) - start ))" >> "$out/same_speed.jsonl" <<'PY'
import json, statistics, sys
path, strategy, tree, code, wall = sys.argv[1:]
try:
    rows = [json.loads(x) for x in open(path)]
    tok = statistics.median(r["tokens_per_s"] for r in rows[3:])
except OSError:
    rows, tok = [], None
print(json.dumps({"strategy": strategy, "tree": tree, "exit": int(code), "wall_s": int(wall), "tokens_per_s": tok,
                  "loss": rows[-1]["loss"] if rows else None}))
PY
    tail -1 "$out/same_speed.jsonl"
    [ "$code" = 0 ] || tail -5 "$w/log"
  done
done

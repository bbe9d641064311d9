#!/usr/bin/env bash
# One GPU call: `bigfit train` at the tree before the typed job and the relayout (b99bdaf, carried as
# .base/src) and at the change (src), single and zero2-offload, alternating, rounds until ~7 minutes.
#   git archive b99bdaf src | tar -x -C .base      (an untracked directory, carried to the device)
#   bash benchmarks/results/2026-12-07-h100-typed-job/call.sh
set -u
out=${OUT:-/tmp/out}; mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; nproc; } > "$out/machine.txt" 2>&1
start=$(date +%s); round=0
while [ $(( $(date +%s) - start )) -lt 300 ]; do
  round=$((round + 1)); echo "round $round" >> "$out/rounds.txt"
  STRATEGIES="single zero2-offload" STEPS=9 OUT="$out" bash benchmarks/same_speed.sh .base/src src
done
cp /tmp/same-speed/log "$out/last.log" 2>/dev/null

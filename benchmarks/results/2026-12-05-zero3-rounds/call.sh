# `bigfit train` against strategies.py's engine loop for zero3 alone, six rounds, every second one
# running the command first (benchmarks/command_vs_engine.py --alternate): 1.5B Llama, bf16, 4 x 1024,
# 16 steps, median after 3, as in ../2026-12-05-h200-command-11b. Its five earlier zero3 rounds put the
# command a median 3.7% over the engine while the engine's own step moved 8-15% between rounds.
# CPU dry run: SCALE=tiny bash call.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; free -g; python -c "import torch; print(torch.__version__)" ) > $OUT/machine.txt 2>&1
if [ "${SCALE:-full}" = tiny ]; then SIZE=tiny; SEQ=64; else SIZE=1b; SEQ=1024; fi
timeout ${LIMIT:-500} python benchmarks/command_vs_engine.py --work /tmp/cve --size $SIZE --seq $SEQ --steps 16 \
  --rows zero3,zero3,zero3,zero3,zero3,zero3 --alternate --out $OUT/cve.jsonl > $OUT/cve.log 2>&1
echo "exit $?" >> $OUT/cve.log
python - $OUT/cve.jsonl <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(r["first"], r.get("engine_step_s"), r.get("command_step_s"), r.get("command_over_engine"))
ratios = [r["command_over_engine"] for r in rows if r.get("command_over_engine")]
print("median", statistics.median(ratios) if ratios else None)
PY

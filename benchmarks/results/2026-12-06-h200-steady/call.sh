# One GPU, two calls on one start. call 1: this host's calibration (`bigfit plan --calibrate`, so the
# rows below are rated with its own issue cost); zero3's `bigfit train` against strategies.py's engine
# loop, six rounds alternated (1.5B Llama, bf16, 4 x 1024, 16 steps, median after 3); T5-large over
# cuda:0 + cpu on today's code (benchmarks/device_map.py: batch 64 compiled, the last decoder block on
# the host, 1 and 2 chunks; the calibrated batch-8 maps are 2026-12-05's dm9 rows). `PART=2`: the 10.9B disk
# tier through benchmarks/largest_model.py to its steady state (10 untimed steps, then 6).
# CPU dry run: TINY=1 bash call.sh; TINY=1 PART=2 bash call.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/call${PART:-1}.log
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; free -g | head -2; date -u +%FT%TZ; df -h /tmp | tail -1 ) > $OUT/machine${PART:-1}.txt
if [ "${PART:-1}" = 2 ]; then
  export BIGFIT_NVME_HOST_GB=${NVME_GB:-111} BIGFIT_NVME_DIR=/tmp/bigfit-nvme
  timeout ${LIMIT:-545} python benchmarks/largest_model.py --methods zero2-offload-nvme+devgrads --layers ${LAYERS:-45} \
    --warmup ${WARMUP:-10} --steps ${STEPS:-6} --timeout 540 ${TINY:+--tiny} --out $OUT/nvme-steady.jsonl >> $L 2>&1
  echo "exit $? $(date +%T)" >> $L; tail -3 $L; exit
fi
echo "== calibrate $(date +%T)" >> $L
timeout 90 python -m bigfit plan --calibrate > $OUT/calibrate.txt 2>&1; cat $OUT/calibrate.txt >> $L
if [ -n "${TINY:-}" ]; then SIZE=tiny; SEQ=64; DM=--tiny; else SIZE=1b; SEQ=1024; DM=; fi
echo "== zero3 rounds $(date +%T)" >> $L
timeout 250 python benchmarks/command_vs_engine.py --work /tmp/cve --size $SIZE --seq $SEQ --steps 16 \
  --rows zero3,zero3,zero3,zero3,zero3,zero3 --alternate --out $OUT/cve.jsonl >> $L 2>&1
echo "== device_map batch 64 compiled $(date +%T)" >> $L
timeout 110 python benchmarks/device_map.py $DM --batch 64 --layouts unsplit,tail --chunks 2 --compile gpu --beams 0 \
  --steps 3 --warmup 1 --out $OUT/device_map64.jsonl >> $L 2>&1
echo "== done $(date +%T)" >> $L
python - $OUT <<'PY'
import json, os, statistics, sys
o = sys.argv[1]
rows = [json.loads(l) for l in open(f"{o}/cve.jsonl")] if os.path.exists(f"{o}/cve.jsonl") else []
for r in rows:
    print("zero3", r["first"], r.get("engine_step_s"), r.get("command_step_s"), r.get("command_over_engine"))
ratios = [r["command_over_engine"] for r in rows if r.get("command_over_engine")]
print("median", statistics.median(ratios) if ratios else None)
for f in ("device_map64",):
    for l in open(f"{o}/{f}.jsonl") if os.path.exists(f"{o}/{f}.jsonl") else []:
        r = json.loads(l); print(f, r["layout"], r["step_s"], r.get("peak_gpu_gb", r.get("peak_gib")))
PY
grep "==" $L

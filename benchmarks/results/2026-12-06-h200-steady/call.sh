# One GPU. This host's calibration first (`bigfit plan --calibrate`: the rows below are rated with its own
# issue cost). Then T5-large over cuda:0 + cpu on today's code, as measured on 2026-12-01
# (benchmarks/device_map.py, each chunked layout again with --sequential: a tick's host segments after its
# GPU segments instead of beside them): batch 64 and 128 with the last decoder block on the host, eager in
# 2 and 4 chunks, and batch 64 compiled in 2; batch 8 with the decoder on the host in 4 chunks. Last, in
# the time left, zero3's `bigfit train` against strategies.py's engine loop, alternated rounds (1.5B
# Llama, bf16, 4 x 1024, 16 steps, median after 3; BUDGET: the call's seconds, 585). `PART=2`: the 10.9B
# disk tier through benchmarks/largest_model.py to its steady state (10 untimed steps, then 6), with
# torch's AdamW on the host as on 2026-11-29.
# BIG=96 on an H100 (80 GB: batch 128 needs 89 GB there).
# CPU dry run: TINY=1 bash call.sh; TINY=1 LAYERS=2 NVME_GB=0.0001 PART=2 bash call.sh
set -u
S=$(date +%s); OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/call${PART:-1}.log
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; free -g | head -2; date -u +%FT%TZ; df -h /tmp | tail -1 ) > $OUT/machine${PART:-1}.txt
if [ "${PART:-1}" = 2 ]; then
  export BIGFIT_NVME_HOST_GB=${NVME_GB:-111} BIGFIT_NVME_DIR=/tmp/bigfit-nvme
  timeout ${LIMIT:-545} python benchmarks/largest_model.py --methods zero2-offload-nvme+devgrads+torchadam --layers ${LAYERS:-45} \
    --warmup ${WARMUP:-10} --steps ${STEPS:-6} --timeout 540 ${TINY:+--tiny} --out $OUT/nvme-steady.jsonl >> $L 2>&1
  echo "exit $? $(date +%T)" >> $L; tail -3 $L; exit
fi
echo "== calibrate $(date +%T)" >> $L
timeout 90 python -m bigfit plan --calibrate > $OUT/calibrate.txt 2>&1; cat $OUT/calibrate.txt >> $L
if [ -n "${TINY:-}" ]; then SIZE=tiny; SEQ=64; DM=--tiny; else SIZE=1b; SEQ=1024; DM=; fi
dm() {  # name, timeout, device_map.py's arguments
  echo "== device_map $1 $(date +%T)" >> $L
  timeout $2 python benchmarks/device_map.py $DM --beams 0 --steps 3 --warmup 1 --sequential "${@:3}" --out $OUT/dm-$1.jsonl >> $L 2>&1
}
# the cases held outside the target by the overlap rule first (a short call still settles it)
dm b${BIG:-128} 120 --batch ${BIG:-128} --layouts tail --chunks 2,4
dm b64-compiled 150 --batch 64 --layouts unsplit,tail --chunks 2 --compile gpu
dm b64 150 --batch 64 --layouts unsplit,tail --chunks 2,4
dm b8 110 --batch 8 --layouts flat --chunks 4
left=$(( ${BUDGET:-585} - $(date +%s) + S ))
echo "== zero3 rounds $(date +%T), ${left} s left" >> $L
[ $left -gt 60 ] && timeout $left python benchmarks/command_vs_engine.py --work /tmp/cve --size $SIZE --seq $SEQ --steps 16 \
  --rows zero3,zero3,zero3,zero3,zero3,zero3 --alternate --out $OUT/cve.jsonl >> $L 2>&1
echo "== done $(date +%T)" >> $L
python - $OUT <<'PY'
import glob, json, os, statistics, sys
o = sys.argv[1]
rows = [json.loads(l) for l in open(f"{o}/cve.jsonl")] if os.path.exists(f"{o}/cve.jsonl") else []
for r in rows:
    print("zero3", r["first"], r.get("engine_step_s"), r.get("command_step_s"), r.get("command_over_engine"))
ratios = [r["command_over_engine"] for r in rows if r.get("command_over_engine")]
print("median", statistics.median(ratios) if ratios else None)
for f in sorted(glob.glob(f"{o}/dm-*.jsonl")):
    for l in open(f):
        r = json.loads(l); print(os.path.basename(f), r["layout"], round(r["step_s"], 4), r["peak_gpu_gb"])
PY
grep "==" $L

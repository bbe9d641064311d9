# `bigfit bench`'s whole table on one machine start, in two calls (a call runs at most 600 s): the seed's
# rows for bigfit (T5-large shape, config only, 128/128, 1024 samples trained, 32 evaluated with beam 4),
# then DeepSpeed ZeRO-2 without and with CPU offload on the same workload (../2026-12-05-h100-peers).
# PART=1: `bigfit plan --calibrate`, then device_map, single fp32, single, zero2, zero3; PART=2:
# zero2-offload, zero3-offload, then DeepSpeed, each search started near the size bigfit's rows held
# (H100: 160 and 189; H200: 288 and 320). ROWS="name[:precision] ..." and PEERS="method:start ..."
# replace a part's lists. Before it, here: bash ../shared/bench/peer_wheels.sh .whl (and carry .whl).
# CPU dry run: TINY=1 SAMPLES=8 ROWS="device_map single:fp32" PEERS= bash call.sh
set -u
S=$(date +%s); OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; date -u +%FT%TZ ) > $OUT/r/machine-${PART:-1}.txt
if [ "${PART:-1}" = 1 ]; then
  timeout 60 python -m bigfit plan --calibrate > $OUT/r/cal.txt 2>&1  # the rows rate this host's issue cost
  ROWS=${ROWS-device_map single:fp32 single zero2 zero3}; PEERS=${PEERS-}
else
  [ "${G:-0}" -gt 100000 ] && P="ds-z2:288 ds-z2-offload:320" || P="ds-z2:160 ds-z2-offload:176"
  ROWS=${ROWS-zero2-offload zero3-offload}; PEERS=${PEERS-$P}
fi
python benchmarks/results/2026-12-04-h200-bench/make_inputs.py /tmp/in ${TINY:+--tiny} > /dev/null
for row in $ROWS; do  # one bench per row: each its own bench.json, and a row cut short loses only itself
  st=${row%:*}; prec=bf16; [ "$row" != "$st" ] && prec=${row#*:}
  left=$(( ${BUDGET_S:-575} - $(date +%s) + S - 25 ))
  if [ $left -lt 80 ]; then echo "$row: ${left} s left, not run" >> $OUT/r/bench.log; continue; fi
  echo "== $row $(date +%T)" >> $OUT/r/bench.log
  timeout $left python -m bigfit bench --model /tmp/in/t5 --data /tmp/in/pairs.jsonl --train-samples ${SAMPLES:-1024} \
    --eval-samples 32 --num-beams 4 --max-new-tokens 32 --max-source-len 128 --max-target-len 128 --untimed-steps 2 \
    --precisions $prec --strategies $st --row-timeout-s $(( left - 15 )) --output-dir /tmp/b-$st-$prec-$S >> $OUT/r/bench.log 2>&1
  mkdir -p $OUT/r/$st-$prec && cp -r /tmp/b-$st-$prec-$S/. $OUT/r/$st-$prec/ 2>/dev/null
done
left=$(( ${BUDGET_S:-575} - $(date +%s) + S - 20 ))
if [ -n "$PEERS" ] && [ $left -gt 80 ]; then
  OUT=$OUT/r/peers PEERS="$PEERS" LIMIT=$left bash benchmarks/results/2026-12-05-h100-peers/call.sh > $OUT/r/peers.txt 2>&1
fi
grep -h "micro-batch auto ->\|fastest\|not run" -r $OUT/r --include=*.log | cut -c1-300 | tail -30
cd $OUT && tar czf results-${PART:-1}.tgz r && rm -rf r

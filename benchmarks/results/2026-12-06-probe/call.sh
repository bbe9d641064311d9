# The probe's full rule on a GPU (a size whose settled probe step needed allocator cache flushes counts
# as full): `bigfit bench` re-measures the rows that sat at the card's edge, where training ran out of
# memory after the probe confirmed a size or the step doubled (zero2-offload 192 on an H100). On an
# H200 DeepSpeed ZeRO-2 without offload comes first with bigfit's zero2 on the same start
# (../2026-12-06-gpu/call.sh ROWS=bench); on an H100 (whose DeepSpeed rows are done) the table's missing
# rows follow in the time left. One archive comes back: results.tgz.
# CPU dry run: TINY=1 ROWS_H100="zero2" BUDGET_S=200 bash call.sh
set -u
S=$(date +%s); OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; date -u +%FT%TZ ) > $OUT/r/machine.txt
if [ "${G:-0}" -gt 100000 ]; then
  OUT=$OUT/r/ds ROWS=bench LIMIT=${DS_LIMIT:-300} LIMIT_ALL=${DS_ALL:-400} bash benchmarks/results/2026-12-06-gpu/call.sh > $OUT/r/ds.txt 2>&1
  ROWS="${ROWS_H200:-zero2-offload single}"
else
  timeout 60 python -m bigfit plan --calibrate > $OUT/r/cal.txt 2>&1  # the bench's rows rate this host
  ROWS="${ROWS_H100:-zero2-offload zero2 zero3-offload device_map}"
fi
python benchmarks/results/2026-12-04-h200-bench/make_inputs.py /tmp/in ${TINY:+--tiny} > /dev/null
for st in $ROWS; do  # one bench per row: each is its own bench.json, and a row cut short loses only itself
  left=$(( ${BUDGET_S:-575} - $(date +%s) + S - 25 ))
  if [ $left -lt 80 ]; then echo "$st: ${left} s left, not run" >> $OUT/r/bench.log; continue; fi
  echo "== $st $(date +%T)" >> $OUT/r/bench.log
  timeout $left python -m bigfit bench --model /tmp/in/t5 --data /tmp/in/pairs.jsonl --train-samples ${SAMPLES:-1024} \
    --eval-samples 32 --num-beams 4 --max-new-tokens 32 --max-source-len 128 --max-target-len 128 --untimed-steps 2 \
    --precisions bf16 --strategies $st --row-timeout-s $(( left - 15 )) --output-dir /tmp/b-$st-$S >> $OUT/r/bench.log 2>&1
  mkdir -p $OUT/r/$st && cp -r /tmp/b-$st-$S/. $OUT/r/$st/ 2>/dev/null
done
grep -h "probe\|full\|flush\|confirmed\|settled" -r $OUT/r --include=*.log --include=*.txt | cut -c1-200 | tail -40
cd $OUT && tar czf results.tgz r && rm -rf r

# The bench's rows left on 2026-12-05 (../2026-12-05-h200-bench-evening): zero2-offload in bf16 (its
# row stopped at a 130 s limit while probing) and single in fp32, on the same workload
# (../2026-12-04-h200-bench/make_inputs.py: the T5-large shape, config only, 128/128-token pairs).
# Each writes its own bench.json; the rows join the evening's table in benchmarks/RESULTS.md.
# CPU dry run: TINY=--tiny SAMPLES=32 bash call.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
END=$(( $(date +%s) + ${BUDGET_S:-570} ))
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; free -g ) > $OUT/machine.txt
python benchmarks/results/2026-12-04-h200-bench/make_inputs.py /tmp/in ${TINY:-}
COMMON="--model /tmp/in/t5 --data /tmp/in/pairs.jsonl --train-samples ${SAMPLES:-1024} --eval-samples 32 --num-beams 4
  --max-new-tokens 32 --max-source-len 128 --max-target-len 128 --untimed-steps 2"
bench() {  # name precision strategy row-limit
  left=$(( END - $(date +%s) - 10 )); limit=$(( $4 < left - 30 ? $4 : left - 30 ))
  [ $limit -lt 60 ] && { echo "$1: no time left" >> $OUT/$1.log; return; }
  timeout $(( limit + 30 )) python -m bigfit bench $COMMON --precisions $2 --strategies $3 --row-timeout-s $limit \
    --output-dir /tmp/b-$1 > $OUT/$1.log 2>&1
  echo "exit $?" >> $OUT/$1.log
  cp /tmp/b-$1/bench.json $OUT/$1-bench.json 2>/dev/null
  grep -h "probe\|micro-batch auto\|first step\|rror" /tmp/b-$1/rows/*/row.log 2>/dev/null | cut -c1-300 > $OUT/$1-rowlogs.txt
}
bench offload bf16 zero2-offload 300
bench fp32 fp32 single 200
grep -h "micro-batch auto\|probe micro\|fastest\|auto would\|exit" $OUT/*.log | cut -c1-250

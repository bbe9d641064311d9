# Second H200 call, prepared 2026-12-05: the compact optimizer states against fp32 at 1B scale on the
# GPU, 500 steps a format, bf16 compute, 4 x 2048 byte tokens a step of running text (this Python's
# standard library), through `bigfit train --strategy zero2-offload` (a 1.0B Llama: 20 x 2048, vocabulary
# 384). Each format's metrics.jsonl lands in $OUT when it finishes; summary.json grows a row a format.
# CPU dry run: SCALE=tiny bash call2.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; free -g ) > $OUT/machine.txt
if [ "${SCALE:-full}" = tiny ]; then
  ARGS="--steps 20 --hidden 64 --layers 2 --precision fp32 --batch 4 --seq 64 --corpus-mb 0.5"
else
  ARGS="--steps 500 --hidden 2048 --layers 20 --precision bf16 --batch 4 --seq 2048 --corpus-mb 8"
fi
( while sleep 20; do for f in fp32 bf16 int8; do cp /tmp/conv/$f/metrics.jsonl $OUT/$f-metrics.jsonl 2>/dev/null; done
  cp /tmp/conv/summary.json $OUT/convergence-1b.json 2>/dev/null; done ) &
timeout 575 python benchmarks/state_convergence.py $ARGS --out /tmp/conv --plot $OUT/convergence-1b.png \
  > $OUT/convergence-1b.log 2>&1
echo "exit $?" >> $OUT/convergence-1b.log
kill %1
for f in fp32 bf16 int8; do cp /tmp/conv/$f/metrics.jsonl $OUT/$f-metrics.jsonl 2>/dev/null; done
cp /tmp/conv/summary.json $OUT/convergence-1b.json 2>/dev/null
cat $OUT/convergence-1b.log

# zero2-offload's step at several micro-batches beside zero2's through `bigfit train`, on one card: is
# the host step hidden under the next forward (planning/estimate.py combine) at every size, or only
# with room left on the card? x: the same with the allocator's expandable segments. CPU dry run:
# TINY=1 PREC=fp32 STEPS=4 RUNS="zero2:4 zero2-offload:4:x" bash call.sh
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1; OUT=${OUT:-/tmp/out}; mkdir -p $OUT/r
nvidia-smi --query-gpu=name --format=csv > $OUT/r/machine.txt 2>&1
if [ -z "${TINY:-}" ]; then python benchmarks/results/2026-12-04-h200-bench/make_inputs.py /tmp/in > /dev/null; M="--model /tmp/in/t5 --data /tmp/in/pairs.jsonl"; fi
G=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ "${G:-0}" -gt 100000 ]; then R="zero2-offload:337 zero2-offload:337:x zero2-offload:256 zero2:256 zero2-offload:300"
else R="zero2-offload:192 zero2-offload:192:x zero2-offload:128 zero2:128 zero2-offload:160"; fi  # the bench's largest, then less
for s in ${RUNS:-$R}; do
  IFS=: read st mb x <<< "$s"  # x: the allocator's expandable segments
  if [ -n "$x" ]; then export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; else unset PYTORCH_CUDA_ALLOC_CONF; fi
  n=$st-$mb${x:+-x}
  timeout 150 python -m bigfit train ${M:-} --strategy $st --nproc 1 --precision ${PREC:-bf16} --micro-batch-size $mb --batch-size $mb \
    --max-steps ${STEPS:-10} --max-source-len 128 --max-target-len 128 --eval-every 0 --no-eval-on-start --no-checkpoints \
    --no-consolidate --eval-samples 0 --output-dir /tmp/o-$n > $OUT/r/$n.log 2>&1
  cp /tmp/o-$n/metrics.jsonl $OUT/r/$n.jsonl
  python -c "import json,sys,statistics as s; r=[json.loads(l) for l in open(sys.argv[1])][2:]; print(sys.argv[2], 'median step s', round(s.median(x['tokens']/x['tokens_per_s'] for x in r),4))" $OUT/r/$n.jsonl $s
done
cd $OUT && tar czf r.tgz r && rm -rf r

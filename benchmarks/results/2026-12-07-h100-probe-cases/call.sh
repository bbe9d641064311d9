# One GPU call (one H100): micro-batch auto's two probe cases through `bigfit train` (benchmarks/probe_cases.sh),
# then an out-of-memory error injected into the offload engine's copy up (gather) and a hang injected into
# its host step on CUDA (gpt-neo-1.3B's shape, 16 GB cap), then the checkpoint, --overwrite and model-file
# tests under the GPU machine's torch and transformers (on its CPU).
#   bash benchmarks/results/2026-12-07-h100-probe-cases/call.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; S=$(date +%s)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
LIMIT_S=${LIMIT_S:-180} bash benchmarks/probe_cases.sh > $OUT/cases.txt 2>&1
NEO="--model /tmp/pc/gpt-neo-1.3b --data /tmp/pc/texts.jsonl --max-source-len 1024 --strategy zero2-offload
  --batch-size auto --precision bf16 --max-steps 2 --no-eval-on-start --eval-every 0 --eval-samples 4 --no-checkpoints"
for fault in ${FAULTS-oom-at:gather:1 hang-at:hoststep:0}; do  # FAULTS= : none
  t0=$(date +%s); echo "== BIGFIT_FAULT=$fault BIGFIT_WAIT_S=30" >> $OUT/inject.log
  BIGFIT_GPU_MEMORY=16GB BIGFIT_FAULT=$fault BIGFIT_WAIT_S=30 timeout 150 python3 -m bigfit train $NEO \
    --output-dir /tmp/o-inject-${fault%%:*} >> $OUT/inject.log 2>&1
  echo "== exit $? after $(( $(date +%s) - t0 )) s" >> $OUT/inject.log
done
CUDA_VISIBLE_DEVICES= timeout 240 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_checkpoint_safety.py \
  tests/test_overwrite_safety.py tests/test_model_files.py} > $OUT/tests-gpu-machine.txt 2>&1
echo "tests exit $?" >> $OUT/tests-gpu-machine.txt
grep -h "auto ->\|probe micro\|first step\|step 1/\|== exit\|== BIG\|error" $OUT/cases.txt $OUT/*.log | cut -c1-240
tail -3 $OUT/tests-gpu-machine.txt; echo "total $(( $(date +%s) - S )) s"

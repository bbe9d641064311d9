# micro-batch auto's two GPU probe cases through `bigfit train --strategy auto --batch-size auto`, one GPU:
# t5-3b's shape on a card capped at 24 GB (bf16, 128/128 tokens) and gpt-neo-1.3B's on 16 GB (bf16, 1024
# tokens, no activation checkpointing). Each case has LIMIT_S seconds; one still running then gets SIGABRT,
# so that each of its processes prints its threads' stacks (PYTHONFAULTHANDLER). Logs come back in $OUT.
#   SRC=src bash benchmarks/probe_cases.sh            # on the GPU machine
#   TINY=1 LIMIT_S=120 bash benchmarks/probe_cases.sh # CPU dry run with tiny shapes
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; S=$(date +%s)
export PYTHONPATH=$PWD/${SRC:-src} PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
( nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; date -u +%FT%TZ
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
) > $OUT/machine.txt 2>&1
python3 benchmarks/probe_cases.py /tmp/pc ${TINY:+--tiny}
COMMON="--strategy auto --batch-size auto --precision bf16 --max-steps ${STEPS:-4} --no-eval-on-start --eval-every 0
  --eval-samples 4 --num-beams 1 --max-new-tokens 4 --no-checkpoints --lr-schedule constant"
case_run() {  # name, card cap, args...
  local name=$1 cap=$2; shift 2
  local t0=$(date +%s)
  echo "== $name $(date +%T) cap $cap" > $OUT/$name.log
  BIGFIT_GPU_MEMORY=$cap setsid python3 -m bigfit train $COMMON --output-dir /tmp/o-$name "$@" >> $OUT/$name.log 2>&1 &
  local pid=$! waited=0
  while kill -0 $pid 2>/dev/null && [ $waited -lt ${LIMIT_S:-240} ]; do sleep 2; waited=$((waited + 2)); done
  if kill -0 $pid 2>/dev/null; then
    echo "== still running after ${LIMIT_S:-240} s: SIGABRT to its processes" >> $OUT/$name.log
    kill -ABRT -- -$pid; sleep 5; kill -KILL -- -$pid 2>/dev/null  # its own process group (setsid), no other
  fi
  wait $pid; echo "== exit $? after $(( $(date +%s) - t0 )) s" >> $OUT/$name.log
  tar czf $OUT/$name-logs.tgz -C /tmp/o-$name logs 2>/dev/null
}
case_run t5-3b-24gb 24GB --model /tmp/pc/t5-3b --data /tmp/pc/pairs.jsonl --max-source-len 128 --max-target-len 128
case_run neo-1.3b-16gb 16GB --model /tmp/pc/gpt-neo-1.3b --data /tmp/pc/texts.jsonl --max-source-len 1024
grep -h "auto ->\|probe micro\|step \|exit\|Error\|error" $OUT/*.log | cut -c1-220 | tail -40
echo "total $(( $(date +%s) - S )) s"

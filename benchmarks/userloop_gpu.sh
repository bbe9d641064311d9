#!/usr/bin/env bash
# One GPU call: bigfit from the user's code beside `bigfit train` and the peers a user would pick instead,
# on a Llama-shaped 3.6B (random init), bf16, micro-batch 4 x 2048, rows into $OUT/userloop.jsonl as they come.
# Carry DeepSpeed (and torchao, for its CPUOffloadOptimizer) in .whl, made here by
#   bash ../shared/bench/peer_wheels.sh .whl
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl torchao
# then: run(command="bash benchmarks/userloop_gpu.sh", carry=[".whl"]).
set -u
out=${OUT:-/tmp/out}; mkdir -p "$out"; rows="$out/userloop.jsonl"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > "$out/machine.txt" 2>&1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >> "$out/install.log" 2>&1
  DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz >> "$out/install.log" 2>&1
fi
export PYTHONPATH=$PWD/src:/tmp/site
A="--size 3b --mbs 4 --seq 2048 --steps 7 --warmup 2 --out $rows"
# bigfit train itself, the figure the Trainer row is held to (within 5%)
w=/tmp/userloop-train; rm -rf $w; mkdir -p $w
python3 - "$w" <<'PY'
import sys
sys.path.insert(0, "benchmarks")
from userloop import model_of
model_of("3b", "meta").config.save_pretrained(sys.argv[1] + "/model")
line = "the quick brown fox jumps over the lazy dog " * 60
open(sys.argv[1] + "/data.txt", "w").write("".join(f"{i} {line}\n" for i in range(256)))
PY
python3 -m bigfit train --model $w/model --data $w/data.txt --strategy zero2-offload --nproc 1 --precision bf16 \
  --batch-size 4 --max-source-len 2048 --max-steps 7 --eval-every 0 --eval-samples 0 --save-every 0 --no-consolidate \
  --lr 1e-5 --output-dir $w/run > $w/log 2>&1
python3 - "$w/run/metrics.jsonl" >> "$rows" <<'PY'
import json, statistics, sys
r = [json.loads(x) for x in open(sys.argv[1])]
print(json.dumps({"method": "bigfit-train", "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in r[2:]), 1),
                  "peak_gpu_gb": r[-1].get("peak_gpu_gb")}))
PY
tail -1 "$rows"
for m in trainer-bigfit loop-prepare optim-bigfit optim-torchao trainer-deepspeed optim-deepspeed; do
  timeout 300 python3 benchmarks/userloop.py $m $A > "$out/$m.log" 2>&1 || echo "{\"method\": \"$m\", \"exit\": $?}" >> "$rows"
  tail -1 "$rows"
done
# strategy auto: prepare's pick and bigfit train's, for the same model and batch
python3 benchmarks/userloop.py auto $A > "$out/auto.log" 2>&1
python3 -m bigfit train --model $w/model --data $w/data.txt --strategy auto --batch-size 4 --max-source-len 2048 \
  --max-steps 1 --eval-every 0 --eval-samples 0 --save-every 0 --no-consolidate --output-dir $w/auto 2>&1 | grep -m1 "strategy auto ->" >> "$out/auto.log"
cat "$out/auto.log" | tail -3

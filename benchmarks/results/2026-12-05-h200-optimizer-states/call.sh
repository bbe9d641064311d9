# One H200 call, prepared 2026-12-05 (not run yet: that day had no device time left), for the compact
# optimizer states' targets (docs/optimizer_states.md, "Not yet"), in about 9 minutes:
# 1. the host step per format on 8 and 16 threads (benchmarks/host_adam.py), and `bigfit plan
#    --calibrate` (the host's rates per format, which --strategy auto then plans with);
# 2. a 10.9B Llama (config only) at 1 x 2048, bf16, checkpointing: `--strategy auto` (expected:
#    zero2-offload, bf16 states in RAM), 8 steps; then int8 states with gradients on the device, 8 steps;
# 3. an 18.4B Llama (43 x 6144) with int8 states in RAM, gradients on the device: 5 steps.
# Each run's log and metrics.jsonl land in $OUT as they finish (8 files: the tool's limit); `free -g`
# sampled every 5 s goes to the end of machine.txt.
# CPU dry run of the same commands: SCALE=tiny bash call.sh (tiny models, fp32, a few steps).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; free -g ) > $OUT/machine.txt
( while true; do free -g | awk '/Mem/{print strftime("%T"), "used", $3, "available", $7}'; sleep 5; done ) >> $OUT/machine.txt &
if [ "${SCALE:-full}" = tiny ]; then
  SHAPES="64 2 4 2 128 32 2 4 2 128"; STEPS=3; PREC=fp32; PARAMS=1048576; THREADS=1,2; LEN=64
else
  SHAPES="4096 45 32 8 14336 6144 43 48 8 16384"; STEPS=8; PREC=bf16; PARAMS=268435456; THREADS=8,16; LEN=2048
fi
python benchmarks/host_adam.py --params $PARAMS --threads $THREADS --json $OUT/host_adam.json > /tmp/host_adam.log 2>&1
python - $SHAPES <<'PY'
import random, string, sys
from transformers import LlamaConfig
h1, l1, a1, k1, i1, h2, l2, a2, k2, i2 = map(int, sys.argv[1:])
for path, (h, layers, heads, kv, inter) in (("/tmp/m11", (h1, l1, a1, k1, i1)), ("/tmp/m18", (h2, l2, a2, k2, i2))):
    LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                intermediate_size=inter, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
                eos_token_id=1, pad_token_id=0, bos_token_id=1).save_pretrained(path)
r = random.Random(0)
open("/tmp/letters.txt", "w").write("".join(r.choice(string.ascii_letters + " ") for _ in range(60000)))
PY
COMMON="--data /tmp/letters.txt --precision $PREC --activation-checkpointing --batch-size 1 --max-source-len $LEN
  --eval-samples 0 --no-checkpoints --overwrite"
run() {  # NAME LIMIT_S ARGS...: a run into /tmp/NAME, its log and metrics into $OUT
  name=$1 limit=$2; shift 2
  timeout $limit python -m bigfit train $COMMON "$@" --output-dir /tmp/$name > $OUT/$name.log 2>&1
  echo "exit $?" >> $OUT/$name.log; cp /tmp/$name/metrics.jsonl $OUT/$name-metrics.jsonl 2>/dev/null
}
# this host's issue cost and Adam rates per format (the figures auto11 plans with), and the 10.9B plan
# with them, at the head of machine.txt's memory samples
python -m bigfit plan --calibrate --model /tmp/m11 --batch-size 1 --seq-len $LEN --precision $PREC \
  --activation-checkpointing >> $OUT/machine.txt 2>&1
# no --nproc: device_map (one process driving the GPU and the host) stays a candidate of auto
run auto11 170 --model /tmp/m11 --strategy auto --max-steps $STEPS
run int8-11 150 --model /tmp/m11 --nproc 1 --strategy zero2-offload --optimizer-states int8 --offload-grads device --max-steps $STEPS
run int8-18 200 --model /tmp/m18 --nproc 1 --strategy zero2-offload --optimizer-states int8 --offload-grads device --max-steps 5
kill %1
grep -h "auto ->\|optimizer-states\|first step\|^step\|exit\|rror" $OUT/auto11.log $OUT/int8-11.log $OUT/int8-18.log | cut -c1-200
tail -12 /tmp/host_adam.log
grep -h "calibrated\|recommended" $OUT/machine.txt | cut -c1-300

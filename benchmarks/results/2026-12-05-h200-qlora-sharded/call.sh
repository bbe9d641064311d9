# One H200 call, prepared 2026-12-05: QLoRA with the 4-bit base sharded by FSDP2 (torchao's NF4Tensor,
# quantize.py) beside the bitsandbytes store, through `bigfit train`, about 7 minutes:
# 1. an 8B Llama shape, r 16 on all linear layers, 4 x 2048, bf16: --strategy single (bitsandbytes'
#    Linear4bit) and --strategy zero3 on one process (torchao's NF4 under FSDP2), 6 steps each;
# 2. a 70.8B Llama shape (80 x 8192), 1 x 2048, checkpointing: --strategy zero3-offload on one process,
#    the 4-bit base's shards in host RAM, copied to the GPU a block at a time, 4 steps;
# 3. the 8B shape under --strategy zero2-offload (the offload engine: the 4-bit base on the GPU, the
#    adapters stepped on the host; planned at 0.69 s against single's 0.82) and --strategy device_map
#    (auto: every block on the GPU, bitsandbytes' layers behind the map's hooks), 6 steps each.
# Before it, here (the GPU machine's image has neither library; carry .whl, 46 MB):
#   pip download -q --no-deps -d .whl torchao==0.18.0
#   pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_24_x86_64 -d .whl bitsandbytes==0.50.2
# CPU dry run: SCALE=tiny bash call.sh (a 2-block 256-wide Llama, 3 steps).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
if [ "${SCALE:-full}" = tiny ]; then
  export PYTHONPATH=$PWD/src
  SHAPES="256 2 4 2 512 256 2 4 2 512"; VOCAB=384; STEPS=3; LEN=32; B8=4
else
  python -m pip install -q --no-index --no-deps --target /tmp/site .whl/torchao-*.whl .whl/bitsandbytes-*.whl > $OUT/pip.txt 2>&1
  export PYTHONPATH=$PWD/src:/tmp/site
  SHAPES="4096 32 32 8 14336 8192 80 64 8 28672"; VOCAB=128256; STEPS=6; LEN=2048; B8=${B8:-4}  # B8=2 on an 80 GB card
fi
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; free -g;
  python -c "import torch, torchao, bitsandbytes; print(torch.__version__, torchao.__version__, bitsandbytes.__version__)" 2>&1 | tail -1 ) > $OUT/machine.txt
python - $VOCAB $SHAPES <<'PY'
import random, string, sys
from transformers import LlamaConfig
v, h1, l1, a1, k1, i1, h2, l2, a2, k2, i2 = map(int, sys.argv[1:])
for path, (h, layers, heads, kv, inter) in (("/tmp/l8", (h1, l1, a1, k1, i1)), ("/tmp/l70", (h2, l2, a2, k2, i2))):
    LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                intermediate_size=inter, vocab_size=v, max_position_embeddings=8192, tie_word_embeddings=False,
                eos_token_id=1, pad_token_id=0, bos_token_id=1).save_pretrained(path)
rng = random.Random(0)
open("/tmp/q.txt", "w").write("".join("".join(rng.choice(string.ascii_letters + " ") for _ in range(2100)) + "\n"
                                      for _ in range(64)))
PY
run() {  # NAME LIMIT_S ARGS...: a run into /tmp/NAME, its log with its metrics.jsonl at the end into $OUT
  # (one file a row: the tool returns 8 files a call)
  name=$1 limit=$2; shift 2; t=$(date +%s)
  timeout $limit python -m bigfit train --data /tmp/q.txt --lora --lora-r 16 --lora-targets all-linear --load-in-4bit \
    --precision bf16 --max-source-len $LEN --eval-samples 0 --no-checkpoints --lr 1e-4 --warmup-steps 0 \
    --lr-schedule constant --overwrite --output-dir /tmp/$name "$@" > $OUT/$name.log 2>&1
  echo "exit $? wall $(( $(date +%s) - t ))" >> $OUT/$name.log
  cat /tmp/$name/metrics.jsonl >> $OUT/$name.log 2>/dev/null; rm -rf /tmp/$name
}
ROWS=${ROWS:-"q8-single q8-zero3 q70-zero3-offload q8-zero2-offload q8-device_map"}  # a shorter call: ROWS="q8-zero3 q8-single"
for row in $ROWS; do case $row in
  q8-single) run q8-single 150 --model /tmp/l8 --strategy single --batch-size $B8 --max-steps $STEPS ;;
  q8-zero3) run q8-zero3 150 --model /tmp/l8 --strategy zero3 --nproc 1 --batch-size $B8 --max-steps $STEPS ;;
  q70-zero3-offload) run q70-zero3-offload 260 --model /tmp/l70 --strategy zero3-offload --nproc 1 --batch-size 1 \
    --max-steps 4 --activation-checkpointing ;;
  q8-zero2-offload) run q8-zero2-offload 120 --model /tmp/l8 --strategy zero2-offload --nproc 1 --batch-size $B8 \
    --max-steps $STEPS ;;
  q8-device_map) run q8-device_map 120 --model /tmp/l8 --strategy device_map --batch-size $B8 --max-steps $STEPS ;;
esac; done
for row in $ROWS; do grep -h "QLoRA\|^step\|exit\|rror\|peak" $OUT/$row.log | cut -c1-200; done

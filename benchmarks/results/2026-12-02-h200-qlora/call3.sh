#!/bin/bash
# one H200 call: QLoRA through bigfit train, an 8B shape (beside the LoRA rows) and a 70B shape
export PYTHONPATH=$PWD/gpu-src/src
python -m pip install -q --no-deps --target $PWD/gpu-src/site gpu-src/bitsandbytes-*.whl > $OUT/pip.txt 2>&1; export PYTHONPATH=$PYTHONPATH:$PWD/gpu-src/site; python -c "import bitsandbytes as b; print(b.__version__)" >> $OUT/pip.txt 2>&1
python - <<'PY'
import random, string
from transformers import LlamaConfig
for name, h, layers, heads, inter in (("l8", 4096, 32, 32, 14336), ("l70", 8192, 80, 64, 28672)):
    LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                intermediate_size=inter, vocab_size=128256, max_position_embeddings=8192,
                tie_word_embeddings=False).save_pretrained(f"/tmp/{name}")
rng = random.Random(0)
open("/tmp/q.txt", "w").write("".join("".join(rng.choice(string.ascii_letters + " ") for _ in range(2100)) + "\n" for _ in range(64)))
PY
run() {  # name model batch extra...
  local name=$1 model=$2 batch=$3; shift 3
  local t=$(date +%s)
  timeout $TMO python -m bigfit train --model $model --data /tmp/q.txt --lora --load-in-4bit --strategy single --precision bf16 \
    --batch-size $batch --max-source-len 2048 --max-steps 5 --eval-every 0 --eval-samples 0 --no-checkpoints --lr 1e-4 \
    --warmup-steps 0 --lr-schedule constant --output-dir /tmp/run-$name "$@" > $OUT/$name.log 2>&1
  echo "exit $? wall $(( $(date +%s)-t ))" >> $OUT/$name.log
  cp /tmp/run-$name/metrics.jsonl $OUT/$name-metrics.jsonl 2>/dev/null; rm -rf /tmp/run-$name
}
TMO=150 run qlora-8b /tmp/l8 4
TMO=330 run qlora-70b /tmp/l70 1 --activation-checkpointing

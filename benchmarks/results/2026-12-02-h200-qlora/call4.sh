#!/bin/bash
# one H200 call: QLoRA of a 165B Llama shape (12288 x 88, MLP 40960)
export PYTHONPATH=$PWD/gpu-src/src:/tmp/bnbsite
rm -rf /tmp/bnbsite; python -m pip install -q --no-deps --upgrade --target /tmp/bnbsite gpu-src/bitsandbytes-*.whl > $OUT/pip.txt 2>&1
python - <<'PY'
import random, string
from transformers import LlamaConfig
LlamaConfig(hidden_size=12288, num_hidden_layers=88, num_attention_heads=96, num_key_value_heads=8,
            intermediate_size=40960, vocab_size=128256, max_position_embeddings=8192,
            tie_word_embeddings=False).save_pretrained("/tmp/l165")
rng = random.Random(0)
open("/tmp/q.txt", "w").write("".join("".join(rng.choice(string.ascii_letters + " ") for _ in range(2100)) + "\n" for _ in range(64)))
PY
t=$(date +%s)
timeout 330 python -m bigfit train --model /tmp/l165 --data /tmp/q.txt --lora --load-in-4bit --strategy single --precision bf16 \
  --batch-size 1 --max-source-len 2048 --max-steps 4 --eval-every 0 --eval-samples 0 --no-checkpoints --lr 1e-4 \
  --warmup-steps 0 --lr-schedule constant --activation-checkpointing --output-dir /tmp/run-165 > $OUT/qlora-165b.log 2>&1
echo "exit $? wall $(( $(date +%s)-t ))" >> $OUT/qlora-165b.log
cp /tmp/run-165/metrics.jsonl $OUT/qlora-165b-metrics.jsonl 2>/dev/null
nvidia-smi --query-gpu=memory.used --format=csv >> $OUT/qlora-165b.log

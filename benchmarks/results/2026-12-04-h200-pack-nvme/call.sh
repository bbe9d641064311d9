# One H200 call (2026-12-04), through `bigfit train` itself:
# 1. --pack against the same instruction pairs unpacked (1.5B Llama config, bf16, 8 x 2048, pairs of
#    20-600 bytes a side, the byte-level tokenizer), 12 steps each, medians after 3;
# 2. the 10.9B zero2-offload-nvme row of 2026-11-29 (4096 x 45, 1 x 2048, checkpointing, gradients on
#    the device, 111 GB of states in RAM) run to a steady state: its record averaged steps 1-2 of sparse
#    files; metrics.jsonl keeps every step.
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/machine.txt; nproc >> $OUT/machine.txt
free -g >> $OUT/machine.txt; df -h /tmp >> $OUT/machine.txt; python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $OUT/machine.txt
PYTHONPATH=$PWD/src timeout 200 python benchmarks/packing.py --size 1b --seq 2048 --batch 8 --steps 12 \
  --out $OUT/packing.jsonl > $OUT/packing.log 2>&1
python - <<'PY'
from transformers import LlamaConfig
LlamaConfig(hidden_size=4096, num_hidden_layers=45, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
            eos_token_id=1, pad_token_id=0, bos_token_id=1).save_pretrained("/tmp/m11b")
import random, string
r = random.Random(0)
open("/tmp/letters.txt", "w").write("".join(r.choice(string.ascii_letters + " ") for _ in range(60000)))
PY
PYTHONPATH=$PWD/src timeout 370 python -m bigfit train --model /tmp/m11b --data /tmp/letters.txt \
  --strategy zero2-offload-nvme --offload-grads device --nvme-host-gb 111 --nvme-dir /tmp/nvme --precision bf16 \
  --activation-checkpointing --batch-size 1 --max-source-len 2048 --max-steps 8 --eval-samples 0 --no-checkpoints \
  --output-dir $OUT/nvme > $OUT/nvme.log 2>&1
echo "exit $?" >> $OUT/nvme.log; free -g >> $OUT/machine.txt
tail -3 $OUT/packing.log; tail -12 $OUT/nvme.log

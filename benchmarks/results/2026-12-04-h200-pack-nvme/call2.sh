# Second H200 call (2026-12-04): the 10.9B zero2-offload-nvme run of call.sh for 20 steps (a steady
# state, which call.sh's 8 did not reach), the disk's direct-I/O write and read speed measured first.
free -g > $OUT/machine2.txt; df -h /tmp >> $OUT/machine2.txt
dd if=/dev/zero of=/tmp/ddtest bs=1M count=4096 oflag=direct 2>> $OUT/disk.txt
dd if=/tmp/ddtest of=/dev/null bs=1M iflag=direct 2>> $OUT/disk.txt; rm -f /tmp/ddtest
python - <<'PY'
from transformers import LlamaConfig
LlamaConfig(hidden_size=4096, num_hidden_layers=45, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
            eos_token_id=1, pad_token_id=0, bos_token_id=1).save_pretrained("/tmp/m11b")
import random, string
r = random.Random(0)
open("/tmp/letters.txt", "w").write("".join(r.choice(string.ascii_letters + " ") for _ in range(60000)))
PY
PYTHONPATH=$PWD/src timeout 540 python -m bigfit train --model /tmp/m11b --data /tmp/letters.txt \
  --strategy zero2-offload-nvme --offload-grads device --nvme-host-gb 111 --nvme-dir /tmp/nvme --precision bf16 \
  --activation-checkpointing --batch-size 1 --max-source-len 2048 --max-steps 20 --eval-samples 0 --no-checkpoints \
  --output-dir $OUT/nvme20 > $OUT/nvme20.log 2>&1
echo "exit $?" >> $OUT/nvme20.log; free -g >> $OUT/machine2.txt
cat $OUT/disk.txt; tail -5 $OUT/nvme20.log

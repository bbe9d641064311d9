# Third H200 call, prepared 2026-12-05 (not run yet): the largest model that starts and runs 5 steps
# with the disk tier beside the RAM (zero2-offload-nvme, int8 states, gradients on the GPU), on the
# H200 machine's 64 GiB disk and 125 GiB of RAM: a 25.0B Llama (60 x 6144; `bigfit plan --gpus 141GB
# --cpu-ram 125GiB --nvme 60GB --nvme-gbps 1.4 ...` plans 55.7 s a step, bound by the disk) after a
# 21.9B (52 x 6144, 28.7 s planned) has run, in the time left; 112 GB of the states in RAM, as the
# plan keeps there (all of them on the 64 GB disk ended the first try in SIGBUS: the disk was full).
# `df` and `free` sampled every 10 s.
# CPU dry run: SCALE=tiny bash call3.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; free -g; df -h /tmp ) > $OUT/machine.txt
( while sleep 10; do echo "$(date +%T) $(free -g | awk '/Mem/{print "used", $3, "avail", $7}') disk $(df -BG --output=used /tmp | tail -1)"; done ) >> $OUT/machine.txt &
if [ "${SCALE:-full}" = tiny ]; then
  SHAPES="2 3"; H=64; HEADS=4; INTER=128; PREC=fp32; LEN=64; LIMIT=120
else
  SHAPES="52 60"; H=6144; HEADS=48; INTER=16384; PREC=bf16; LEN=2048; LIMIT=420
fi
END=$(( $(date +%s) + ${BUDGET_S:-570} ))  # the call's own limit: the second shape gets what is left
python - $H $HEADS $INTER $SHAPES <<'PY'
import random, string, sys
from transformers import LlamaConfig
h, heads, inter, *layers = map(int, sys.argv[1:])
for n in layers:
    LlamaConfig(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=min(8, heads),
                intermediate_size=inter, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
                eos_token_id=1, pad_token_id=0, bos_token_id=1).save_pretrained(f"/tmp/m{n}")
r = random.Random(0)
open("/tmp/letters.txt", "w").write("".join(r.choice(string.ascii_letters + " ") for _ in range(60000)))
PY
for n in $SHAPES; do
  left=$(( END - $(date +%s) )); [ $left -lt $LIMIT ] && LIMIT=$left
  [ $LIMIT -lt 60 ] && { echo "no time left for $n" >> $OUT/machine.txt; break; }
  timeout $LIMIT python -m bigfit train --model /tmp/m$n --data /tmp/letters.txt --precision $PREC \
    --activation-checkpointing --batch-size 1 --max-source-len $LEN --eval-samples 0 --no-checkpoints --overwrite \
    --nproc 1 --strategy zero2-offload-nvme --optimizer-states int8 --offload-grads device --max-steps 5 \
    --nvme-host-gb ${NVME_HOST:-112} \
    --output-dir /tmp/n$n > $OUT/nvme-$n.log 2>&1
  code=$?; echo "exit $code" >> $OUT/nvme-$n.log; cp /tmp/n$n/metrics.jsonl $OUT/nvme-$n-metrics.jsonl 2>/dev/null
  rm -rf /tmp/n$n
  [ $code = 0 ] || break  # the larger one only after the smaller ran
done
kill %1
grep -h "auto ->\|nvme\|first step\|^step\|exit\|rror" $OUT/nvme-*.log | cut -c1-200

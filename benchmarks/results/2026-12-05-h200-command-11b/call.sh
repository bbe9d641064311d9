# One GPU call, 2026-12-05 (evening), about 9 minutes (timeouts 250 + 3 x 88 s):
# 1. `bigfit train` against strategies.py's engine loop (benchmarks/command_vs_engine.py) for every strategy
#    the harness has, zero3 twice, alternated with the others (1.5B Llama, bf16, 4 x 1024, 16 steps,
#    median after 3);
# 2. the 10.9B Llama (config only, 1 x 2048, bf16, checkpointing) under zero2-offload with bf16 states
#    in RAM: exact with clipping (the auto pick of the last call), without clipping (each bucket steps
#    during backward), and --delayed-update; 10 steps each.
# CPU dry run: SCALE=tiny bash callA.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; free -g; python -c "import torch; print(torch.__version__)" ) > $OUT/machine.txt 2>&1
if [ "${SCALE:-full}" = tiny ]; then
  SIZE=tiny; CSEQ=64; SHAPE="64 2 4 2 128"; STEPS=4; PREC=fp32; LEN=64; ROWS=zero3,zero2,zero3
else
  SIZE=1b; CSEQ=1024; SHAPE="4096 45 32 8 14336"; STEPS=10; PREC=bf16; LEN=2048
  ROWS=zero3,zero2,zero3-offload,zero3
fi
timeout 250 python benchmarks/command_vs_engine.py --work /tmp/cve --size $SIZE --seq $CSEQ --steps 16 \
  --rows $ROWS --out $OUT/cve.jsonl > $OUT/cve.log 2>&1
echo "exit $?" >> $OUT/cve.log
python - $SHAPE <<'PY'
import random, string, sys
from transformers import LlamaConfig
h, layers, heads, kv, inter = map(int, sys.argv[1:])
LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
            intermediate_size=inter, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
            eos_token_id=1, pad_token_id=0, bos_token_id=1).save_pretrained("/tmp/m11")
r = random.Random(0)
open("/tmp/letters.txt", "w").write("".join(r.choice(string.ascii_letters + " ") for _ in range(60000)))
PY
COMMON="--model /tmp/m11 --data /tmp/letters.txt --precision $PREC --activation-checkpointing --batch-size 1
  --max-source-len $LEN --eval-samples 0 --no-checkpoints --overwrite --nproc 1 --strategy zero2-offload
  --optimizer-states bf16 --max-steps $STEPS"
for row in "clip" "noclip --max-grad-norm 0" "delayed --delayed-update"; do
  set -- $row; name=$1; shift
  timeout 88 python -m bigfit train $COMMON "$@" --output-dir /tmp/$name > /tmp/$name.log 2>&1
  echo "== $name exit $?" >> $OUT/big.log
  grep -h "first step\|^step\|rror\|Killed" /tmp/$name.log | cut -c1-160 >> $OUT/big.log
  cat /tmp/$name/metrics.jsonl >> $OUT/big-metrics.jsonl 2>/dev/null
done
tail -4 $OUT/cve.log | cut -c1-400; cat $OUT/big.log

#!/usr/bin/env bash
# One GPU call (under 10 minutes): the longest sequence one GPU trains, bigfit against plain Hugging Face
# with gradient checkpointing (benchmarks/longseq.py), on Llama-3-8B's shape (and 70B's on a card of
# 100 GB or more), random init, bf16. Rows go to $OUT/longseq.jsonl as they come, each length's log to
# $OUT/longseq-logs/, the machine to $OUT/machine.txt. Parts, in priority order (PARTS picks some):
#   full32k     bigfit 8B full fine-tune at 32K tokens (tokens/s)
#   search      bigfit 8B full: longest, doubling up from 64K (target >= 128K), then bigfit plan's prediction
#   plain       plain HF + gradient checkpointing 8B full: longest, from 8K
#   lora        bigfit 8B LoRA: longest, from 64K
#   plainlora   plain HF + peft LoRA 8B: longest, from 16K
#   qlora70     70B QLoRA, bigfit then plain bitsandbytes + peft: longest, from 16K (skipped under 100 GB)
# Each part gets what is left of BUDGET_S (default 520 s from the start); each length a time limit of its
# own (longseq.py stops a hung one's whole process group), so one length cannot eat the call.
# peft and bitsandbytes, where the machine lacks them, come from .whl/longseq, made here by
#   python3 -m pip download -q --no-deps -d .whl/longseq peft==0.22.0
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_24_x86_64 -d .whl/longseq bitsandbytes==0.50.2
# then: run(command="bash benchmarks/longseq_gpu.sh", carry=[".whl"]); a later call for the rest:
#   run(command="PARTS='lora plainlora qlora70' bash benchmarks/longseq_gpu.sh", carry=[".whl"]).
set -u
start=$(date +%s); end=$(( start + ${BUDGET_S:-520} ))
out=${OUT:-/tmp/out}; mkdir -p "$out"; rows="$out/longseq.jsonl"
parts=${PARTS:-full32k search plain lora plainlora qlora70}
for pkg in peft bitsandbytes; do  # the machine's own where it has one
  python3 -c "import $pkg" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site \
    .whl/longseq/$pkg-*.whl >> "$out/install.log" 2>&1
done
export PYTHONPATH=$PWD/src:/tmp/site
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
  python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"
  python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)"; } > "$out/machine.txt" 2>&1
card_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)

# longseq PART ARGS...: one longseq.py call with what is left of the budget (none under 60 s)
longseq() {
  local part=$1; shift
  case " $parts " in *" $part "*) ;; *) return ;; esac
  local left=$(( end - $(date +%s) ))
  if [ "$left" -lt 60 ]; then echo "{\"part\": \"$part\", \"error\": \"skipped: ${left} s left\"}" >> "$rows"; return; fi
  echo "== $part ($left s left)"
  python3 benchmarks/longseq.py --precision bf16 --budget "$left" --out "$rows" "$@" ${EXTRA:-} 2>> "$out/longseq.stderr"
}
# the CPU check of this script: SHAPE=tiny SEQ_DIV=128 MAX_SEQ=1024 (lengths / 128, none past 1024);
# EXTRA: more longseq.py flags for every part (--strategy single)
shape=${SHAPE:-8b}; div=${SEQ_DIV:-1}
n() { echo $(( $1 / div )); }
S8="--shape $shape --steps 2 --max-seq ${MAX_SEQ:-1048576}"
longseq full32k $S8 --steps 3 --mode full --method bigfit --seq $(n 32768) --timeout 300
longseq search $S8 --mode full --method bigfit --search --seq $(n 65536) --min-seq $(n 32768) --timeout 330
longseq plain $S8 --mode full --method plain --search --seq $(n 8192) --min-seq $(n 1024) --timeout 180
longseq lora $S8 --mode lora --method bigfit --search --seq $(n 65536) --min-seq $(n 16384) --timeout 300
longseq plainlora $S8 --mode lora --method plain --search --seq $(n 16384) --min-seq $(n 2048) --timeout 240
case " $parts " in *" qlora70 "*)
  if [ "${card_mib:-0}" -ge 95367 ]; then  # 100 GB: an H200
    S70="--shape ${SHAPE:-70b} --steps 2 --max-seq ${MAX_SEQ:-1048576} --mode qlora"
    longseq qlora70 $S70 --method bigfit --search --seq $(n 16384) --min-seq $(n 2048) --timeout 300
    longseq qlora70 $S70 --method plain --search --seq $(n 8192) --min-seq $(n 1024) --timeout 240
  else
    echo "{\"part\": \"qlora70\", \"error\": \"skipped: the card has ${card_mib:-no} MiB, under 100 GB (70B needs an H200)\"}" >> "$rows"
  fi;;
esac
echo "done in $(( $(date +%s) - start )) s"; cat "$rows"

# One H200 call (2026-12-04):
# 1. the host's issue cost per traced operator and the forward's share of it (benchmarks/host_issue.py:
#    the calibration's small Llama, a 1.2B Llama shape, T5-large; one short sample, the GPU waiting on the host);
# 2. T5-large over cuda:0 + cpu at batch 16 (unsplit, flat, split; 1 and 2 chunks), a batch no device-map row
#    had, predicted before the call (predicted-before.json);
# 3. the zero2-offload rows of 2026-11-29/30 (3.6B and 1.5B Llama, 4 x 2048) again on today's engine:
#    eager with clipping, without (steps in backward), delayed, gradients on the device, torch's AdamW.
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/machine.txt; nproc >> $OUT/machine.txt
free -g >> $OUT/machine.txt; python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $OUT/machine.txt
export PYTHONPATH=$PWD/src
L=$OUT/call.log
echo "== host_issue $(date +%T)" >> $L
timeout 150 python benchmarks/host_issue.py --out $OUT/host_issue.jsonl >> $L 2>&1
echo "== device_map $(date +%T)" >> $L
timeout 200 python benchmarks/device_map.py --batch 16 --layouts unsplit,flat,split --chunks 2 --beams 0 --steps 3 \
  --warmup 1 --out $OUT/device_map.jsonl >> $L 2>&1
echo "== offload 3.6B $(date +%T)" >> $L
timeout 330 python benchmarks/strategies.py --size 3b --mbs 4 --seq 2048 --steps 6 --warmup 2 --strategies \
  zero2-offload,zero2-offload+eager,zero2-offload+delayed,zero2-offload+devgrads,zero2-offload+delayed+devgrads,zero2-offload+torchadam,zero2-offload+delayed+torchadam \
  --out $OUT/offload3b.jsonl >> $L 2>&1
echo "== offload 1.5B $(date +%T)" >> $L
timeout 100 python benchmarks/strategies.py --size 1b --mbs 4 --seq 2048 --steps 6 --warmup 2 \
  --strategies zero2-offload,zero2-offload+torchadam --out $OUT/offload1b.jsonl >> $L 2>&1
echo "== done $(date +%T)" >> $L
grep -v '"trace"' $L | tail -40

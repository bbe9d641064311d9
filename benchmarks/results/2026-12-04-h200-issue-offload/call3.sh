# Third H200 call (2026-12-04): the remaining zero2-offload rows of 2026-11-29 made with torch's AdamW as
# the host step (no clipping; gradients on the device, after backward and delayed), on today's engine.
export PYTHONPATH=$PWD/src
L=$OUT/call3.log
timeout 200 python benchmarks/strategies.py --size 3b --mbs 4 --seq 2048 --steps 6 --warmup 2 --strategies \
  zero2-offload+torchadam+eager,zero2-offload+torchadam+devgrads,zero2-offload+delayed+torchadam+devgrads \
  --out $OUT/offload3b-torch.jsonl >> $L 2>&1
grep -v '"trace"' $L | tail -5

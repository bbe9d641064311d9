# Second H200 call (2026-12-04): what compiling each block (`--compile`) leaves of the host's issue cost
# (benchmarks/host_issue.py --compile 0,1: a 1.2B Llama shape and T5-large, one short sample), and
# T5-large compiled over cuda:0 + cpu with its last decoder block on the host (tail) at batch 64, 1 and 2
# chunks, as on 2026-12-01, on today's code.
export PYTHONPATH=$PWD/src
L=$OUT/call2.log
echo "== host_issue compiled $(date +%T)" >> $L
timeout 300 python benchmarks/host_issue.py --compile 0,1 --models llama-1.2b,t5-large --out $OUT/host_issue2.jsonl >> $L 2>&1
echo "== device_map compiled tail $(date +%T)" >> $L
timeout 240 python benchmarks/device_map.py --batch 64 --layouts unsplit,tail --chunks 2 --compile gpu --beams 0 \
  --steps 3 --warmup 1 --out $OUT/device_map2.jsonl >> $L 2>&1
echo "== done $(date +%T)" >> $L
tail -25 $L

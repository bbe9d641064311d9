#!/usr/bin/env bash
# Issue 5's measurements in one call of the GPU machine (see RESULTS.md), peers in the same call:
#   bash benchmarks/gpu_offload.sh [SIZE] [PART]   (carry .whl: DeepSpeed's wheels and peers.py, see
#                                                   ../shared/bench/peer_wheels.sh)
# PART: "main" (limits, no accumulation), "accum" (4 micro-batches a step) or "all" (both; over
# 600 s for 3b, so the per-call limit makes it two calls).
# Writes $OUT/limits.json, $OUT/offload.jsonl (bigfit and peer rows) and $OUT/timeline.png.
set -u
size=${1:-3b}; part=${2:-all}; out=${OUT:-/tmp/out}; mkdir -p "$out"
export PYTHONPATH=$PWD/src:/tmp/site
[ -n "${BIGFIT_SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
[ -n "${BIGFIT_SKIP_INSTALL:-}" ] || DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz 2>&1 | tail -1
common="--size $size --mbs 4 --seq 2048 --steps 4 --warmup 2"
if [ "$part" != accum ]; then
  python3 benchmarks/offload_limits.py --out "$out/limits.json"
  python3 benchmarks/strategies.py $common --strategies single,zero2-offload,zero2-offload+delayed,zero2-offload+eager --out "$out/offload.jsonl"
  python3 .whl/peers.py all $common --methods torch,fsdp2-offload,ds-z2-offload | tee -a "$out/peers.txt"
  python3 benchmarks/plot_trace.py "$out/offload.jsonl" "bigfit zero2-offload" "$out/timeline.png"
fi
if [ "$part" != main ]; then
  python3 benchmarks/strategies.py $common --accum 4 --strategies zero2-offload,zero2-offload+delayed,zero2-offload+eager --out "$out/offload.jsonl"
  python3 .whl/peers.py all $common --accum 4 --methods torch,ds-z2-offload | tee -a "$out/peers.txt"
fi

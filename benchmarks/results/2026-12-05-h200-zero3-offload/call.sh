# One H200 call, prepared 2026-12-05 (not run: no device machine was lent that day), about 4 minutes:
# bigfit's zero3-offload beside FSDP2's own CPU offload on peers.py's workload (1.5B Llama, 4 x 2048,
# bf16), in one call. On 2026-11-29/30 zero3-offload took 1.44-1.60 s a step (1.49 s without clipping)
# where FSDP2 + CPUOffloadPolicy took 0.77 s with the same fused AdamW over the same host shards; on the
# CPU machine that step over FSDP2's DTensor shards runs at 0.65-1.0 of plain tensors' rate
# (benchmarks/fsdp_host_step.py), not a third, so the difference is around it. The rows: zero3-offload
# with and without clipping, the peer, and zero2-offload as the reference between them; then the host
# step alone on 16 cores.
# Before it, here: mkdir -p .bench && cp ../shared/bench/peers.py .bench/ (and carry .bench).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src
( nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g; python -c "import torch; print(torch.__version__)" ) \
  > $OUT/machine.txt 2>&1
python benchmarks/strategies.py --size 1b --mbs 4 --seq 2048 --steps 6 --warmup 2 \
  --strategies zero3-offload,zero3-offload+noclip,zero2-offload --out $OUT/bigfit.jsonl > $OUT/bigfit.log 2>&1
python .bench/peers.py all --size 1b --mbs 4 --seq 2048 --methods fsdp2-offload > $OUT/peers.log 2>&1
python benchmarks/fsdp_host_step.py --hidden 2048 --layers 16 --vocab 128256 --steps 5 > $OUT/host_step.log 2>&1
tail -8 $OUT/bigfit.log $OUT/peers.log $OUT/host_step.log

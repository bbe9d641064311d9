# The host's figures beside the host-bound rows they decide (one call, 2026-12-06): `bigfit plan
# --calibrate` (issue cost per operator, host Adam rates; kept for the bench row below) and pinned
# host <-> GPU copies; benchmarks/host_issue.py (the calibration's small Llama, a 1.2B Llama, T5-large)
# at the start and the small Llama again at the end (a host's speed moves between machine starts);
# between them T5-large single and over cuda:0 + cpu at 8 x 256/64 (unchunked and 4 chunks) and single
# at 16, as the device-map rows of 2026-11-29 and 2026-12-04 whose host was never calibrated; then, in
# the time left, `bigfit bench`'s zero2 bf16 row on the bench's workload (the same card's baseline for
# DeepSpeed ZeRO-2 without offload: peers.sh).
# CPU dry run: TINY=1 bash host.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
END=$(( $(date +%s) + ${BUDGET_S:-570} ))
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; free -g
  python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" ) > $OUT/machine-host.txt 2>&1
L=$OUT/host.log
if [ -n "${TINY:-}" ]; then T="--tiny"; DM="--tiny"; else T=""; DM=""; fi
echo "== calibrate $(date +%T)" >> $L  # the host's figures the planner keeps: issue cost, Adam rates
timeout 120 python -m bigfit plan --calibrate >> $L 2>&1
timeout 60 python - >> $L 2>&1 <<'PY'  # host <-> GPU over pinned memory (Hardware.pcie_gbps)
import time, torch
if torch.cuda.is_available():
    h, d = torch.empty(2**30, dtype=torch.uint8).pin_memory(), torch.empty(2**30, dtype=torch.uint8, device="cuda")
    for name, dst, src in (("h2d", d, h), ("d2h", h, d)):
        dst.copy_(src, non_blocking=True); torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(5): dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(); print(f"pcie {name} {5 * 2**30 / (time.perf_counter() - t) / 1e9:.1f} GB/s")
PY
if [ "${ROWS:-all}" = all ]; then  # ROWS=bench: the calibration, then the bench row alone
  echo "== host_issue $(date +%T)" >> $L
  timeout 150 python benchmarks/host_issue.py $T --out $OUT/host_issue.jsonl >> $L 2>&1
  echo "== device_map b8 $(date +%T)" >> $L
  timeout 150 python benchmarks/device_map.py $DM --batch 8 --layouts unsplit,split --chunks 4 --beams 0 --steps 3 \
    --warmup 1 --out $OUT/device_map.jsonl >> $L 2>&1
  echo "== device_map b16 $(date +%T)" >> $L
  timeout 60 python benchmarks/device_map.py $DM --batch 16 --layouts unsplit --chunks 1 --beams 0 --steps 3 --warmup 1 \
    --out $OUT/device_map.jsonl >> $L 2>&1
  echo "== host_issue again $(date +%T)" >> $L
  timeout 60 python benchmarks/host_issue.py $T --models calibration-llama --out $OUT/host_issue.jsonl >> $L 2>&1
fi
echo "== bench zero2 $(date +%T)" >> $L
python benchmarks/results/2026-12-04-h200-bench/make_inputs.py /tmp/in ${TINY:+--tiny} > /dev/null
left=$(( END - $(date +%s) - 40 ))
if [ $left -gt 90 ]; then
  timeout $(( left + 30 )) python -m bigfit bench --model /tmp/in/t5 --data /tmp/in/pairs.jsonl --train-samples \
    ${SAMPLES:-1024} --eval-samples 32 --num-beams 4 --max-new-tokens 32 --max-source-len 128 --max-target-len 128 \
    --untimed-steps 2 --precisions bf16 --strategies zero2 --row-timeout-s $left --output-dir /tmp/b-zero2 >> $L 2>&1
  cp /tmp/b-zero2/bench.json $OUT/zero2-bench.json 2>/dev/null
else echo "bench zero2: no time left" >> $L; fi
echo "== done $(date +%T)" >> $L
grep -v '"trace"' $L | grep -v "^\s*$" | tail -30 | cut -c1-300

# One H200 call (2026-12-03): torch's profiler over steps 7-9 of zero3 (1.5B Llama, bf16, 4 x 1024) in
# strategies.py's loop and in `bigfit train`, twice each, alternated.
D=benchmarks/results/2026-12-03-h200-zero3-diag
for r in 1 2; do for m in engine command; do
  mkdir -p $OUT/r$r; rm -rf /tmp/diag/run
  PYTHONPATH=$PWD/src timeout 200 python $D/diag.py $m $OUT/r$r 1b 1024 2>&1 | grep -E "DIAG|RESULT|Error" | cut -c1-300
done; done

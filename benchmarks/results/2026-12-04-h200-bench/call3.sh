# The bench call's second half (call.sh has single, zero2, zero3 and device_map in bf16): the offload
# rows in bf16, whose probes step the host optimizer at every size, then single in fp32. The rows of
# both calls make one table in benchmarks/RESULTS.md (each call writes its own bench.json).
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/machine.txt; nproc >> $OUT/machine.txt
export PYTHONPATH=$PWD/src
python benchmarks/results/2026-12-04-h200-bench/make_inputs.py /tmp/in
COMMON="--model /tmp/in/t5 --data /tmp/in/pairs.jsonl --train-samples 1024 --eval-samples 32 --num-beams 4
  --max-new-tokens 32 --max-source-len 128 --max-target-len 128 --untimed-steps 2"
timeout 430 python -m bigfit bench $COMMON --precisions bf16 --strategies zero2-offload,zero3-offload \
  --row-timeout-s 210 --output-dir /tmp/bench > $OUT/call.log 2>&1
echo "exit $?" >> $OUT/call.log
cp /tmp/bench/bench.md /tmp/bench/bench.json /tmp/bench/bench.png $OUT/ 2>/dev/null
timeout 150 python -m bigfit bench $COMMON --precisions fp32 --strategies single --row-timeout-s 140 \
  --output-dir /tmp/bench32 >> $OUT/call.log 2>&1
echo "exit $?" >> $OUT/call.log
cp /tmp/bench32/bench.json $OUT/bench-fp32.json 2>/dev/null
tail -20 $OUT/call.log

# One H200 call (2026-12-04): `bigfit bench` on a T5-large shape (config only) with translation-like
# pairs filling 128/128 tokens (make_inputs.py), bf16 over single, zero2, zero3 and device_map (auto:
# all on cuda:0 when it fits); call3.sh has the offload rows and single in fp32. On an H100
# (2026-12-05) a row took 100-150 s (probes, 1024 samples, a 32-sample beam-4 evaluation).
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/machine.txt; nproc >> $OUT/machine.txt
export PYTHONPATH=$PWD/src
python benchmarks/results/2026-12-04-h200-bench/make_inputs.py /tmp/in
COMMON="--model /tmp/in/t5 --data /tmp/in/pairs.jsonl --train-samples 1024 --eval-samples 32 --num-beams 4
  --max-new-tokens 32 --max-source-len 128 --max-target-len 128 --untimed-steps 2 --row-timeout-s 170"
timeout 570 python -m bigfit bench $COMMON --precisions bf16 \
  --strategies single,zero2,zero3,device_map --output-dir /tmp/bench > $OUT/call.log 2>&1
echo "exit $?" >> $OUT/call.log
cp /tmp/bench/bench.md /tmp/bench/bench.csv /tmp/bench/bench.json /tmp/bench/bench.png $OUT/ 2>/dev/null
tail -20 $OUT/call.log

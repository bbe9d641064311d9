# Second H200 call for the bench (prepared 2026-12-05, not run yet): the seed's rows for the peers on
# call.sh's workload (its make_inputs.py: a T5-large shape, config only, 128/128-token pairs): plain
# PyTorch (autocast bf16) and DeepSpeed ZeRO-2 without and with CPU offload (the seed's bucket sizes),
# each with its largest micro-batch found by probing, 1024 samples' train time, a 32-sample beam-4
# evaluation and its BLEU (benchmarks/peers_t5.py).
# Before it, here: bash ../shared/bench/peer_wheels.sh .whl (and carry .whl). DeepSpeed's CPU Adam
# compiles on first use (about 70 s).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz
export PYTHONPATH=/tmp/site:$PWD/src
python benchmarks/results/2026-12-04-h200-bench/make_inputs.py /tmp/in
timeout ${LIMIT:-560} python benchmarks/peers_t5.py --model /tmp/in/t5 --data /tmp/in/pairs.jsonl \
  --methods torch,ds-z2,ds-z2-offload --train-samples 1024 --eval-samples 32 --num-beams 4 --max-new-tokens 32 \
  --timeout 120 --json $OUT/peers.json > $OUT/peers.log 2>&1
echo "exit $?" >> $OUT/peers.log
tail -8 $OUT/peers.log

# DeepSpeed ZeRO-2 with and without CPU offload on the bench's workload (../2026-12-04-h200-bench:
# make_inputs.py, the T5-large shape, config only, 128/128-token pairs), the seed's config
# (benchmarks/peers_t5.py). Each grows its micro-batch by --step from a start near bigfit's own largest
# (zero2 326, zero2-offload 337 on the H200) in one process until a size runs out of memory: a
# DeepSpeed engine does not recover, and a process per bisection step costs ~30 s here.
# PEERS="ds-z2:256" runs one (method:start). Before it, here: bash ../shared/bench/peer_wheels.sh .whl
# (and carry .whl).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
END=$(( $(date +%s) + ${LIMIT:-500} ))
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site || exit
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
( nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g; which nvcc ) > $OUT/machine.txt 2>&1
python benchmarks/results/2026-12-04-h200-bench/make_inputs.py /tmp/in > /dev/null
peer() {  # method start
  left=$(( END - $(date +%s) )); [ $left -lt 60 ] && { echo "$1: no time left" >> $OUT/peers.log; return; }
  timeout $left python benchmarks/peers_t5.py --model /tmp/in/t5 --data /tmp/in/pairs.jsonl --methods $1 \
    --start $2 --step 16 --resolution 16 --train-samples 1024 --eval-samples 32 --num-beams 4 --max-new-tokens 32 \
    --timeout 200 --json $OUT/$1.json > $OUT/$1.log 2>&1
  echo "$1 exit $?" >> $OUT/$1.log; grep '^{' $OUT/$1.log >> $OUT/peers.log
}
for p in ${PEERS:-ds-z2-offload:288 ds-z2:256}; do peer ${p%:*} ${p#*:}; done  # method:start
cat $OUT/peers.log | cut -c1-600

# One call: DeepSpeed's rows (peers.sh), then in the time left the host's figures and the rows they
# decide with bigfit's zero2 row (host.sh). What comes back is one archive (a call returns at most
# 8 files): results.tgz.
S=$(date +%s); OUT=${OUT:-/tmp/out}; mkdir -p $OUT
bash benchmarks/results/2026-12-06-gpu/peers.sh
L=$(( ${LIMIT_ALL:-575} - $(date +%s) + S ))
if [ $L -gt 150 ]; then BUDGET_S=$L bash benchmarks/results/2026-12-06-gpu/host.sh; else echo "host.sh: ${L} s left, not run"; fi
cd $OUT && tar czf /tmp/results.tgz * && rm -rf $OUT/* && mv /tmp/results.tgz $OUT/

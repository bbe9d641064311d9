# DeepSpeed ZeRO-2 without and with CPU offload on `bigfit bench`'s workload (../2026-12-05-h100-peers/call.sh:
# the seed's config, the T5-large shape, 128/128 tokens), each micro-batch search started near bigfit's
# own largest on the card that came (zero2 326 and zero2-offload 337 on the H200); on an H100 without
# offload alone (its offload row was measured there on 2026-12-05: ../2026-12-05-h100-peers).
# Before it, here: bash ../shared/bench/peer_wheels.sh .whl, and carry .whl.
M=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${M:-0}" -gt 100000 ]; then P="ds-z2:288"; else  # ds-z2-offload:320 ran at 01:45 (README)
  P="ds-z2:160"; fi
P=${PEERS:-$P}  # PEERS="ds-z2:288" runs one
echo "peers $P" > ${OUT:-/tmp/out}/starts.txt
PEERS="$P" LIMIT=${LIMIT:-530} bash benchmarks/results/2026-12-05-h100-peers/call.sh

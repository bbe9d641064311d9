# One H200 call: where the time to the first step goes (metrics.jsonl startup_s), and a device map's
# host RSS at start with per-module loading (gpu-src: this tree) against the whole-model host copy
# before it (gpu-old: d145266). Each row in its own process: host_rss_gib is the largest child's peak.
set -x
W=/tmp/cve; B="python gpu-src/benchmarks/command_vs_engine.py --start-only --work $W"
{ nvidia-smi --query-gpu=name,memory.total --format=csv; free -g; df -h /tmp; nproc; } > $OUT/machine.txt 2>&1
row() { tag=$1; src=$2; shift 2; PYTHONPATH=$PWD/$src/src timeout 420 $B "$@" --out $OUT/rows.jsonl > $OUT/$tag.log 2>&1; \
        python -c "import json,sys; r=[json.loads(l) for l in open('$OUT/rows.jsonl')][-1]; r['tag']='$tag'; print(json.dumps(r))" >> $OUT/tagged.jsonl; }
row z2o-3b-config gpu-src --size 3b --rows zero2-offload --mbs 4 --seq 2048
row dm-6b-w-new gpu-src --size 6b --weights --rows device_map --mbs 1 --seq 2048
row dm-6b-w-old gpu-old --size 6b --weights --rows device_map --mbs 1 --seq 2048
row z2o-6b-w gpu-src --size 6b --weights --rows zero2-offload --mbs 4 --seq 2048
df -h /tmp >> $OUT/machine.txt

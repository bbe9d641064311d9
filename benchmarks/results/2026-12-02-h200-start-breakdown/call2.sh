# One H200 call: torch's CPU allocator on 2 MB pages (bigfit's default now) against 4 KB pages
# (THP_MEM_ALLOC_ENABLE=0) for the time to the first step; the device map's rows again with the
# weights in the page cache for both (call 1 ran the new code first, on a cold cache).
set -x
W=/tmp/cve; B="python gpu-src/benchmarks/command_vs_engine.py --start-only --work $W"
{ cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; nproc; free -g; } > $OUT/machine.txt 2>&1
{ time PYTHONPATH=$PWD/gpu-src/src python -c "import bigfit.train.loop"; time python -c "import torch; torch.zeros(1, device='cuda')"; } > $OUT/imports.txt 2>&1
row() { tag=$1; src=$2; shift 2; PYTHONPATH=$PWD/$src/src timeout 300 $B "$@" --out $OUT/rows.jsonl > $OUT/$tag.log 2>&1; \
        python -c "import json,sys; r=[json.loads(l) for l in open('$OUT/rows.jsonl')][-1]; r['tag']='$tag'; print(json.dumps(r))" >> $OUT/tagged.jsonl; }
THP_MEM_ALLOC_ENABLE=0 row z2o-3b-config-4k gpu-src --size 3b --rows zero2-offload --mbs 4 --seq 2048
row z2o-3b-config-2m gpu-src --size 3b --rows zero2-offload --mbs 4 --seq 2048
mkdir -p $W; PYTHONPATH=$PWD/gpu-src/src:$PWD/gpu-src/benchmarks python -c "from pathlib import Path; from command_vs_engine import write_inputs; write_inputs(Path('$W'), '6b', 2048, True)"
cat $W/model-6b-w/*.safetensors > /dev/null  # in the page cache for every row
THP_MEM_ALLOC_ENABLE=0 row z2o-6b-w-4k gpu-src --size 6b --weights --rows zero2-offload --mbs 4 --seq 2048
row z2o-6b-w-2m gpu-src --size 6b --weights --rows zero2-offload --mbs 4 --seq 2048
row dm-6b-w-old gpu-old --size 6b --weights --rows device_map --mbs 1 --seq 2048
row dm-6b-w-new gpu-src --size 6b --weights --rows device_map --mbs 1 --seq 2048

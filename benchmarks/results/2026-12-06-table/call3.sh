# After the table (call.sh PART=1 and 2): what `--strategy auto --batch-size auto` picks among its
# strategies on this card (auto_pick.py, after `bigfit plan --calibrate`), then `bigfit train` beside
# its engine under zero2 in rounds, every second one with the command first
# (benchmarks/command_vs_engine.py --alternate: 1.5B Llama, bf16, 4 x 1024, 16 steps, median after 3).
# CPU dry run: SCALE=tiny ROUNDS=zero2,zero2 bash call3.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
( nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; nproc; date -u +%FT%TZ ) > $OUT/machine-3.txt
timeout 60 python -m bigfit plan --calibrate > $OUT/cal-3.txt 2>&1
python benchmarks/results/2026-12-04-h200-bench/make_inputs.py /tmp/in ${TINY:+--tiny} > /dev/null
timeout 120 python benchmarks/results/2026-12-06-table/auto_pick.py /tmp/in/t5 /tmp/in/pairs.jsonl > $OUT/auto_pick.txt 2>&1
if [ "${SCALE:-full}" = tiny ]; then SIZE=tiny; SEQ=64; else SIZE=1b; SEQ=1024; fi
timeout ${LIMIT:-420} python benchmarks/command_vs_engine.py --work /tmp/cve --size $SIZE --seq $SEQ --steps 16 \
  --rows ${ROUNDS:-zero2,zero2,zero2,zero2} --alternate --out $OUT/cve.jsonl > $OUT/cve.log 2>&1
echo "exit $?" >> $OUT/cve.log
cat $OUT/auto_pick.txt; python -c "
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows: print(r['first'], r.get('engine_step_s'), r.get('command_step_s'), r.get('command_over_engine'))
ratios = [r['command_over_engine'] for r in rows if r.get('command_over_engine')]
print('median', statistics.median(ratios) if ratios else None)" $OUT/cve.jsonl

# One H200 call (2026-12-03): `bigfit train --strategy zero3` against strategies.py's engine loop on the
# same shape (1.5B Llama, bf16, 4 x 1024, 16 steps, median after 3), three rounds alternated in one call
# to tell the command's cost from the run-to-run spread; single once beside them.
W=/tmp/cve; nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/machine.txt; nproc >> $OUT/machine.txt
PYTHONPATH=$PWD/src timeout 570 python benchmarks/command_vs_engine.py --work $W --size 1b --seq 1024 --steps 16 \
  --rows zero3,single,zero3,zero3 --out $OUT/rows.jsonl > $OUT/log.txt 2>&1
tail -5 $OUT/log.txt

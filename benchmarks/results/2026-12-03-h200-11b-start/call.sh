# One H200 call (2026-12-03): the 10.9B Llama with bf16 safetensors weights (random, written by
# command_vs_engine.py's save_bf16 in 410 s on this machine) trained by `bigfit train --strategy device_map`
# with activation checkpointing, 1 x 2048: time to the first step and the host's peak RSS.
W=/tmp/cve; free -g > $OUT/machine.txt; df -h /tmp >> $OUT/machine.txt
PYTHONPATH=$PWD/src timeout 560 python benchmarks/command_vs_engine.py --start-only --work $W --size 11b --weights \
  --rows device_map+ckpt --mbs 1 --seq 2048 --out $OUT/rows.jsonl > $OUT/log.txt 2>&1

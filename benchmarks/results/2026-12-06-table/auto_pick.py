"""What `--strategy auto --batch-size auto` picks among the table's strategies on this machine (as
`bigfit bench` asks it, bench/command.py `_auto_pick`): run after `bigfit plan --calibrate`.

  python auto_pick.py /tmp/in/t5 /tmp/in/pairs.jsonl"""
import sys

from bigfit.bench.command import _auto_pick
from bigfit.config import TrainConfig

base = TrainConfig(model=sys.argv[1], data=sys.argv[2], precision="bf16", max_source_len=128, max_target_len=128,
                   max_train_samples=1024)
for strategies in ({"single", "zero2", "zero3", "zero2-offload", "zero3-offload", "device_map"},
                   {"single", "zero2", "zero3", "device_map"}):
    print(sorted(strategies), "->", *_auto_pick(base, strategies), flush=True)

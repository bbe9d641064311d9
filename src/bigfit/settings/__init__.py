"""The settings: TrainConfig and its ranges (config.py), reading them as users write them (reading.py),
user files, the DeepSpeed-config import, `bigfit plan`'s and `bigfit bench`'s own settings and what a
resumed run may change. Declarations and reading only: importing them loads no torch
(config.auto_precision asks torch when it is called)."""

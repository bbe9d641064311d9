"""The settings: TrainConfig and its ranges (config.py), reading them as users write them (reading.py),
user files, the DeepSpeed-config import, `bigfit plan`'s extra flags and what a resumed run may
change. Declarations and reading only: nothing here loads torch."""

"""bigfit: train transformer models that do not fit on one device.

Public API: `TrainConfig` and `train` (one rank of a job; the `bigfit` command launches the ranks),
`consolidate` (sharded checkpoint -> Hugging Face directory), `apply_strategy` (the transforms).
"""
from .config import TrainConfig
from .errors import BigfitError

__all__ = ["BigfitError", "TrainConfig", "apply_strategy", "consolidate", "train"]


def __getattr__(name):  # heavy imports (torch, transformers) only when used
    if name == "train":
        from .train.loop import train

        return train
    if name == "consolidate":
        from .train.consolidate import consolidate

        return consolidate
    if name == "apply_strategy":
        from .strategies import apply_strategy

        return apply_strategy
    raise AttributeError(name)

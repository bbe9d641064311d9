"""bigfit: train transformer models that do not fit on one device.

Public API: `TrainConfig` and `train` (one rank of a job; the `bigfit` command launches the ranks),
`consolidate` (sharded checkpoint -> Hugging Face directory), `apply_strategy` (the transforms),
`parallelize` / `deparallelize` (device-map model parallelism in one process, bigfit.device_map).
"""
from .config import TrainConfig
from .errors import BigfitError

__all__ = ["BigfitError", "TrainConfig", "apply_strategy", "consolidate", "deparallelize", "parallelize", "train"]


def __getattr__(name):  # heavy imports (torch, transformers) only when used
    if name == "train":
        from .train.loop import train

        return train
    if name == "consolidate":
        from .train.consolidate import consolidate

        return consolidate
    if name in ("parallelize", "deparallelize", "device_map"):
        import importlib

        device_map = importlib.import_module(".device_map", __name__)  # `from . import` would recurse here
        return device_map if name == "device_map" else getattr(device_map, name)
    if name == "apply_strategy":
        from .strategies import apply_strategy

        return apply_strategy
    raise AttributeError(name)

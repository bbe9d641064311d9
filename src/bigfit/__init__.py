"""bigfit: train transformer models that do not fit on one device.

Public API: `train` and `plan` (bigfit train and bigfit plan from Python, returning data: api/__init__.py;
`run` is `train`),
`TrainConfig`, `consolidate` (sharded checkpoint -> Hugging Face directory), `ParallelPlan` / `plan_for` (a job's
parallel layout, from a strategy name and degrees) and `apply_plan` (its transforms, in order),
`parallelize` / `deparallelize` (device-map model parallelism in one process, bigfit.device_map),
`prepare` (bigfit's engines in the user's own loop: bigfit.userloop), `launch` (a function on N new processes of
this machine, each a rank: from a notebook).
"""
import logging

from .errors import BigfitError
from .settings.config import TrainConfig

from .layout.plan import ParallelPlan, plan_for

# transformers imports torchao (the QLoRA extra, adapters/quantize.py) to register its quantizers whenever it
# loads a model; torchao then logs a warning for each CUDA kernel it could not load, and torch one for
# each enum torchao registers; peft imports bitsandbytes, whose CPU backend logs that it found no
# downloaded kernel (bigfit's CPU QLoRA is torchao's): on every run, none of them the user's concern
for _name in ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu"):
    logging.getLogger(_name).setLevel(logging.ERROR)

__all__ = ["BigfitError", "ParallelPlan", "TrainConfig", "apply_plan", "consolidate", "deparallelize", "launch",
           "parallelize", "plan", "plan_for", "prepare", "run", "train"]


def __getattr__(name):  # heavy imports (torch, transformers) only when used
    if name in ("train", "run", "plan"):  # the training package is bigfit.training: bigfit.train is the call
        from . import api

        return getattr(api, name)
    if name in ("optim", "hf"):  # bigfit.optim.OffloadAdamW; bigfit.hf.use(trainer): submodules, imported when used
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name == "prepare":
        from .userloop.prepare import prepare

        return prepare
    if name == "launch":  # bigfit.launch(fn, nproc=N): userloop/launch.py
        from .userloop.launch import launch

        return launch
    if name == "consolidate":
        from .outputs.consolidate import consolidate

        return consolidate
    if name in ("parallelize", "deparallelize", "device_map"):
        import importlib

        device_map = importlib.import_module(".device_map", __name__)  # `from . import` would recurse here
        return device_map if name == "device_map" else getattr(device_map, name)
    if name == "apply_plan":
        from .parallel.apply import apply

        return apply
    raise AttributeError(name)

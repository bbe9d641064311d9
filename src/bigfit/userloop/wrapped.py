"""The model as the user's loop calls it (`Forward`), and the refusal of a model that another wrapper
already spreads (`check_unwrapped`).

`Forward` replaces the instance's `forward` (accelerate wraps forwards the same way for its
autocast), so the model object the user calls stays the engine's own (a DDP or FSDP2 module keeps
its hooks, `isinstance` and attributes): each call runs under the engine's forward context (its
autocast), and the first call of a micro-step opens the engine's accumulation context, which its
backward closes. `remove` restores the forward there was.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from ..engine import Engine
from ..errors import BigfitError

# wrappers that spread a model themselves: bigfit's strategies start from the plain model
WRAPPERS = {"DistributedDataParallel": "DDP", "DataParallel": "DataParallel", "FullyShardedDataParallel": "FSDP",
            "FSDPModule": "FSDP2's fully_shard", "DeepSpeedEngine": "DeepSpeed", "PipelineEngine": "DeepSpeed"}


def check_unwrapped(model) -> None:
    """One line for a model that DDP, FSDP, FSDP2 or DeepSpeed already wraps or shards, or that
    from_pretrained(device_map=...) spread over several devices."""
    if isinstance(model, str):
        return
    names = {cls.__name__ for cls in type(model).__mro__}
    if by := next((label for name, label in WRAPPERS.items() if name in names), None):
        raise BigfitError(f"bigfit.prepare(): the model is already wrapped by {by}; pass the plain model "
                          "(bigfit's strategy shards or replicates it: strategy='zero3', 'ddp', ...)")
    if any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()):
        raise BigfitError("bigfit.prepare(): the model's parameters are already sharded (DTensors, from FSDP2 or "
                          "tensor parallelism); pass the model before it was sharded")
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        raise BigfitError(f"bigfit.prepare(): the model is spread over {len(devices)} devices by from_pretrained("
                          "device_map=...); load it without device_map and pass strategy='device_map'")


class Forward:
    """The engine's forward context around each call of `model`, and its accumulation context from
    a micro-step's first forward to its backward. `last()`: whether the micro-step under way ends the
    accumulation (its gradients are reduced)."""

    def __init__(self, model: torch.nn.Module, engine: Engine, last: Callable[[], bool]):
        self.model, self.engine, self.last = model, engine, last
        self.open: contextlib.ExitStack | None = None
        self.before = model.__dict__.get("forward")  # an instance forward already there (restored by remove)
        original = model.forward

        @functools.wraps(original)  # its signature: Trainer keeps the dataset columns that forward names
        def forward(*args, **kwargs):
            if self.open is None and torch.is_grad_enabled() and model.training:
                self._open()
            with engine.forward_context():
                return original(*args, **kwargs)

        model.forward = forward

    def _open(self) -> None:
        self.open = contextlib.ExitStack()
        self.open.enter_context(self.engine.accumulation_context(self.last()))

    @contextlib.contextmanager
    def backward(self):
        """Around one backward: the micro-step's accumulation context (opened here if its forward did
        not pass through the model's forward), closed after it."""
        if self.open is None:
            self._open()
        try:
            yield
        finally:
            self.open, stack = None, self.open
            stack.close()

    def remove(self) -> None:
        if self.before is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self.before

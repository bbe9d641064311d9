"""Measured model-state memory: the bytes this rank holds for parameters, gradients and optimizer
states, per device type, counted from the actual tensors (the local shard of a DTensor; a memory
region shared by tied parameters once; tensors that are views into one buffer each by their own size). The planner's predictions are checked against this, and so are the strategies' promises."""
from __future__ import annotations

from collections import defaultdict

import torch

from . import local


def _add(acc: dict, seen: set, t) -> None:
    if not isinstance(t, torch.Tensor):
        return
    t = local(t)
    key = (t.data_ptr(), t.numel(), t.device)
    if key in seen or t.device.type == "meta":
        return
    seen.add(key)
    where = "nvme" if t.device.type == "cpu" and t.untyped_storage().filename else t.device.type  # file-backed
    acc[where] += t.numel() * t.element_size()


def state_bytes(engine) -> dict[str, dict[str, int]]:
    """{"params"|"grads"|"optimizer": {"cuda"|"cpu"|"nvme": bytes}} for this rank (nvme: file-backed),
    from the tensors the engine says it holds (`Engine.memory_tensors`)."""
    out = {k: defaultdict(int) for k in ("params", "grads", "optimizer")}
    seen: set = set()
    held = engine.memory_tensors()
    for kind in ("params", "grads", "optimizer"):
        for t in held[kind]:
            if kind != "optimizer" or (isinstance(t, torch.Tensor) and t.dim() > 0):  # not step counters
                _add(out[kind], seen, t)
    return {k: dict(v) for k, v in out.items()}

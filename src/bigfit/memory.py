"""Measured model-state memory: the bytes this rank holds for parameters, gradients and optimizer
states, per device type, counted from the actual tensors (the local shard of a DTensor; a memory
region shared by tied parameters once; tensors that are views into one buffer each by their own size). The planner's predictions are checked against this, and so are the strategies' promises."""
from __future__ import annotations

from collections import defaultdict

import torch

from .strategies import local


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


def state_bytes(applied, optimizer) -> dict[str, dict[str, int]]:
    """{"params"|"grads"|"optimizer": {"cuda"|"cpu"|"nvme": bytes}} for this rank (nvme: file-backed). Host master weights of
    an offloading optimizer count as optimizer state (they exist only for the optimizer)."""
    out = {k: defaultdict(int) for k in ("params", "grads", "optimizer")}
    seen: set = set()
    for p in applied.model.parameters():
        _add(out["params"], seen, p)
    for p in applied.model.parameters():
        _add(out["grads"], seen, p.grad)
    for g in getattr(optimizer, "grad_buffers", ()):  # the offload engine's host gradient buffers
        _add(out["grads"], seen, g)
    # ZeroRedundancyOptimizer keeps this rank's states in its local `optim`
    for state in getattr(optimizer, "optim", optimizer).state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # per-element states, not step counters
                _add(out["optimizer"], seen, v)
    for m in getattr(optimizer, "masters", ()):
        _add(out["optimizer"], seen, m)
    return {k: dict(v) for k, v in out.items()}

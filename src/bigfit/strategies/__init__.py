"""Strategies: post-construction transforms of an unmodified model.

`apply_strategy` is the one place where they are applied, always in this order (torchtitan's):
    split (device map / pipeline stages) -> tensor parallel -> activation checkpointing
    -> compile -> sharding (DDP / ZeRO via FSDP2) -> offload
Only the sharding step exists so far; each later transform slots into its place in `apply_strategy`.
"""
from __future__ import annotations

import torch

from ..distributed import Runtime
from .base import Applied
from .sharding import apply_ddp, apply_fsdp

__all__ = ["Applied", "apply_strategy"]


def apply_strategy(model: torch.nn.Module, strategy: str, precision: str, rt: Runtime) -> Applied:
    model.to(rt.device)
    dtype = torch.bfloat16 if precision == "bf16" else None
    if strategy == "zero3" and rt.distributed:
        return apply_fsdp(model, rt, param_dtype=dtype)
    if strategy == "ddp" and rt.distributed:
        return apply_ddp(model, rt, autocast=dtype)
    # one process: every data-parallel strategy is the plain model; nothing to shard or reduce
    return Applied(model=model, module=model, strategy=strategy, autocast=dtype)

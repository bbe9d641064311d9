"""Strategies: post-construction transforms of an unmodified model.

`apply_strategy` is the one place where they are applied, always in this order (torchtitan's):
    split (device map / pipeline stages) -> tensor parallel -> activation checkpointing
    -> compile -> sharding (DDP / ZeRO via FSDP2) -> offload
Splitting, tensor parallelism and compile are later work; each slots into its place here.
"""
from __future__ import annotations

import torch

from ..distributed import Runtime
from ..precision import DTYPES, compute_dtype
from .base import Applied, local
from .checkpointing import apply_activation_checkpointing
from .sharding import apply_ddp, apply_fsdp

__all__ = ["FSDP_STRATEGIES", "Applied", "apply_strategy", "build_optimizer", "local"]

# Strategies built on FSDP2; they run on a one-rank mesh too (offload and parameter casting need it).
FSDP_STRATEGIES = ("zero2", "zero3", "zero2-offload", "zero3-offload")


def apply_strategy(model: torch.nn.Module, cfg, rt: Runtime) -> Applied:
    """Move, checkpoint and shard `model` as `cfg.strategy` / `cfg.precision` say."""
    compute = compute_dtype(cfg.precision)
    if cfg.strategy != "zero3-offload":  # zero3-offload's parameters stay in host RAM; FSDP2 moves shards
        model.to(rt.device)
    notes = []
    if cfg.activation_checkpointing:
        notes.append(f"activation checkpointing on {apply_activation_checkpointing(model)} blocks")
    if cfg.strategy in FSDP_STRATEGIES:
        applied = apply_fsdp(model, cfg.strategy, rt, compute, DTYPES[cfg.reduce_dtype])
    elif cfg.strategy in ("ddp", "zero1") and rt.distributed:
        applied = apply_ddp(model, cfg.strategy, rt, compute, cfg.ddp_bucket_mb)
    else:  # one process, nothing to shard or reduce
        applied = Applied(model=model, module=model, strategy=cfg.strategy, autocast=compute)
    applied.notes[:0] = notes
    return applied


def build_optimizer(applied: Applied, cfg) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay) or Adam (L2), placed where the strategy keeps its states."""
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    # torch's fused kernels (CUDA and CPU): on the GPU machine the multi-tensor loop made the host-side
    # step of zero3-offload 4.5x slower than FSDP2's own offload with fused AdamW (benchmarks/RESULTS.md)
    return applied.make_optimizer(cls, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay, fused=True)

"""Activation checkpointing per block: each block's forward runs under torch.utils.checkpoint
(non-reentrant), so only block inputs are kept and the rest is recomputed in backward. `blocks`
checkpoints the first N of each stack only (the rest keep their activations: faster, where memory
allows some); `offload` keeps those inputs in pinned host RAM instead of on the device
(actoffload.py).

The block's own `forward` is shadowed by an instance attribute, which `remove_activation_checkpointing`
deletes: parameter names, state dicts and the model's class are untouched. It is applied before
sharding (FSDP2's hooks sit around the block call, outside the checkpointed region, so a block's
parameters are gathered again before its recompute)."""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from ..models.source import block_lists
from .actoffload import ActivationOffload, OffloadedForward


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: torch.nn.Module, blocks: int | None = None, offload: bool = False) -> int:
    """Checkpoint the first `blocks` of each stack found by `block_lists` (None: every block), their
    inputs in host RAM with `offload`; returns how many blocks."""
    owner = ActivationOffload() if offload else None  # one pinned pool and side stream per device for the model
    n = 0
    for s, (_, stack) in enumerate(block_lists(model)):
        for i, block in enumerate(list(stack)[:blocks]):
            block.forward = OffloadedForward(block.forward, owner, s, i) if offload else \
                functools.partial(_checkpointed, block.forward)
            n += 1
    return n


def remove_activation_checkpointing(model: torch.nn.Module) -> None:
    """Put back each block's own forward (checkpointed or offloaded)."""
    for _, stack in block_lists(model):
        for block in stack:
            forward = block.__dict__.get("forward")
            if isinstance(forward, OffloadedForward) or (
                    isinstance(forward, functools.partial) and forward.func is _checkpointed):
                del block.forward

"""Activation checkpointing per block: each block's forward runs under torch.utils.checkpoint
(non-reentrant), so only block inputs are kept and the rest is recomputed in backward.

The block's own `forward` is shadowed by an instance attribute, which `remove_activation_checkpointing`
deletes: parameter names, state dicts and the model's class are untouched. It is applied before
sharding (FSDP2's hooks sit around the block call, outside the checkpointed region, so a block's
parameters are gathered again before its recompute)."""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from ..models.source import block_lists


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: torch.nn.Module) -> int:
    """Checkpoint every block found by `block_lists`; returns how many."""
    n = 0
    for _, blocks in block_lists(model):
        for block in blocks:
            block.forward = functools.partial(_checkpointed, block.forward)
            n += 1
    return n


def remove_activation_checkpointing(model: torch.nn.Module) -> None:
    for _, blocks in block_lists(model):
        for block in blocks:
            if isinstance(block.__dict__.get("forward"), functools.partial):
                del block.forward

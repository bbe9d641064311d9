"""torch.compile per block: the documented order's "compile" step, after activation checkpointing
and before sharding (torchtitan's order).

Why per block, not the whole model: the blocks of a stack share one compiled graph per kind of
block (T5 has four: the first block of each stack makes the position bias, and the encoder's differ
from the decoder's), so a deep model compiles in the time of a shallow one; everything around the
blocks stays eager, which is where bigfit's own hooks sit (FSDP2's, the offload engine's, a device
map's, which switch threads and devices) and where models keep their Python (masks, the loss).

Why at all: a small model's step is bound by the host issuing its kernels one Python op at a time.
Compiled, a block runs as a few fused kernels issued from generated code: T5-large's step on an H200
took 1.72x less time (benchmarks/RESULTS.md, 2026-12-01), and that is what lets a GPU stage of a
chunked device map work longer than the host takes to issue it.

- `dynamic=True`: one graph serves every micro-batch size (the last batch, device-map chunks).
- Training only: a block in eval mode or under no_grad (evaluation, `generate()`, whose cache grows
  every step) runs its plain forward.
- Like checkpointing, the block's `forward` is shadowed by an instance attribute; `remove_compile`
  puts back the one that was there. Parameter names, state dicts and the model's class do not change.
"""
from __future__ import annotations

import torch

from ..models.source import block_lists


class _Compiled:
    """A block's forward: compiled while the block trains, the previous forward otherwise."""

    def __init__(self, block: torch.nn.Module, backend: str):
        self.block, self.eager = block, block.forward
        self.shadowed = "forward" in block.__dict__  # activation checkpointing's, say
        self.compiled = torch.compile(self.eager, backend=backend, dynamic=True)

    def __call__(self, *args, **kwargs):
        if self.block.training and torch.is_grad_enabled():
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def apply_compile(model: torch.nn.Module, backend="inductor", where=None) -> int:
    """Compile every block found by `block_lists` (those `where(block)` accepts, if given) with
    `backend` (a name or a callable, as torch.compile takes it); returns how many."""
    n = 0
    for _, blocks in block_lists(model):
        for block in blocks:
            if where is None or where(block):
                block.forward = _Compiled(block, backend)
                n += 1
    return n


def remove_compile(model: torch.nn.Module) -> None:
    for _, blocks in block_lists(model):
        for block in blocks:
            compiled = block.__dict__.get("forward")
            if not isinstance(compiled, _Compiled):
                continue
            if compiled.shadowed:
                block.forward = compiled.eager
            else:
                del block.forward  # the class's own forward again

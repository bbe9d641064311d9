"""The offload engine's memory layout: parameters grouped into buckets, each parameter split by rows.

Every parameter is split along dim 0 the way a DTensor `Shard(0)` is: ceil(rows / world) rows per
rank, the last ranks holding fewer (or none). A bucket is a run of parameters (one transformer
block, or consecutive non-block parameters up to a size), and on each rank its local part is one flat
buffer: the rank's rows of each parameter, one after another, each padded to the full per-rank
size. So
- one reduce-scatter of a (world, S) buffer gives each rank its rows of every gradient in the bucket;
- one all-gather of each rank's S updated values gives every rank the whole bucket;
- each parameter's host state is a view into the flat buffer that a DTensor can wrap, which is what
  makes checkpoints reshardable and consolidation give fp32 weights.
Pure layout and copy helpers; the engine (engine.py) decides when they run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Slot:
    """One parameter's place in its bucket."""
    name: str
    param: torch.nn.Parameter
    rows: int  # rows per rank (ceil(dim 0 / world))
    row_numel: int  # elements in one row
    offset: int  # start in the bucket's per-rank flat buffer

    @property
    def span(self) -> int:
        return self.rows * self.row_numel

    def local_rows(self, rank: int) -> int:
        total = self.param.shape[0] if self.param.dim() else 1
        return max(0, min(total, (rank + 1) * self.rows) - rank * self.rows)


@dataclass
class Bucket:
    index: int
    slots: list[Slot]
    numel: int  # per-rank flat size S
    state: dict = field(default_factory=dict)  # the engine's per-step bookkeeping


def _slot(name: str, p: torch.nn.Parameter, world: int, offset: int) -> Slot:
    total = p.shape[0] if p.dim() else 1
    rows = math.ceil(total / world)
    return Slot(name, p, rows, p.numel() // total if total else 0, offset)


def group_parameters(model: torch.nn.Module, block_prefixes: list[str], max_numel: int) -> list[list[tuple]]:
    """(name, parameter) groups in registration order (about forward order): one per block, and runs
    of non-block parameters merged up to `max_numel`. Tied parameters appear once."""
    groups: list[tuple[str | None, list]] = []  # (block prefix, or None for non-block runs; members)
    for name, p in model.named_parameters():  # deduplicated: a tied parameter under its first name
        if not p.requires_grad:
            continue
        block = next((b for b in block_prefixes if name.startswith(b + ".")), None)
        last = groups[-1] if groups else (False, [])
        same_block = block is not None and last[0] == block
        fits_run = block is None and last[0] is None and sum(q.numel() for _, q in last[1]) + p.numel() <= max_numel
        if same_block or fits_run:
            last[1].append((name, p))
        else:
            groups.append((block, [(name, p)]))
    return [members for _, members in groups]


def make_buckets(groups: list[list[tuple]], world: int) -> list[Bucket]:
    buckets = []
    for i, members in enumerate(groups):
        slots, offset = [], 0
        for name, p in members:
            slots.append(_slot(name, p, world, offset))
            offset += slots[-1].span
        buckets.append(Bucket(i, slots, offset))
    return buckets


def local_view(flat: torch.Tensor, slot: Slot, rank: int) -> torch.Tensor:
    """This rank's rows of the parameter, as a view into the bucket's flat buffer."""
    start, length = local_span(slot, rank)
    shape = (slot.local_rows(rank), *slot.param.shape[1:]) if slot.param.dim() else ()
    return flat[start:start + length].view(shape)


def local_span(slot: Slot, rank: int) -> tuple[int, int]:
    """(start, length) of this rank's rows of the parameter in the bucket's per-rank flat buffer."""
    return slot.offset, slot.local_rows(rank) * slot.row_numel


def _rank_chunks(full2d: torch.Tensor, slot: Slot, world: int):
    """The slot's part of a (world, S) buffer as (world, rows, row_numel), with rows and row_numel."""
    rows, rest = slot.rows, slot.row_numel
    return full2d[:, slot.offset:slot.offset + slot.span].view(world, rows, rest), rows, rest


def pack(out: torch.Tensor, slot: Slot, grad: torch.Tensor, accumulate: bool) -> None:
    """Write (or add) a full gradient into the (world, S) buffer, rank r's rows in row r."""
    world = out.shape[0]
    mine, rows, rest = _rank_chunks(out, slot, world)
    g = grad.reshape(-1, rest)
    full, part = divmod(g.shape[0], rows)
    op = torch.Tensor.add_ if accumulate else torch.Tensor.copy_
    op(mine[:full], g[:full * rows].view(full, rows, rest))
    if part:
        op(mine[full, :part], g[full * rows:])


def unpack(gathered: torch.Tensor, slot: Slot, param: torch.Tensor) -> None:
    """Copy a parameter's rows out of the all-gathered (world, S) buffer into the parameter."""
    world = gathered.shape[0]
    mine, rows, rest = _rank_chunks(gathered, slot, world)
    p = param.view(-1, rest)
    full, part = divmod(p.shape[0], rows)
    p[:full * rows].view(full, rows, rest).copy_(mine[:full])
    if part:
        p[full * rows:].copy_(mine[full, :part])

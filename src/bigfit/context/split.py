"""Which tokens of every sequence a context-parallel rank holds, and its slice of a batch.

The sequence is cut into 2 x cp equal chunks; rank r takes chunk r and chunk 2cp-1-r (one from
either end). Under a causal mask a late token attends to more keys than an early one, so contiguous
slices would leave the last rank with most of the work; a pair from both ends gives every rank the
same (Megatron's and torchtitan's load balancing). Labels are shifted over the WHOLE sequence before
it is cut: a slice's last token predicts the first token of the next chunk, which another rank holds."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.tokenize import IGNORE


def local_positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions this rank holds of a sequence of `length` (a multiple of 2 x cp), in its order."""
    c = length // (2 * cp)
    first, last = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(last, last + c, device=device)])


def gathered_order(length: int, cp: int, device=None) -> torch.Tensor:
    """For keys gathered rank after rank (each rank's two chunks in its order), the index of each global
    position among them: gathered[:, :, order] is the sequence in its own order."""
    held = torch.cat([local_positions(length, cp, r) for r in range(cp)])
    order = torch.empty_like(held)
    order[held] = torch.arange(length)
    return order.to(device)


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position t's target is token t+1 (decoder-only); the last position has none."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)


@dataclass
class Slice:
    """One rank's part of a batch: what the model reads and what the attention needs to know of the rest."""
    inputs: dict  # input_ids and position_ids (the whole sequence's), this rank's tokens
    targets: torch.Tensor  # the shifted labels of this rank's tokens
    positions: torch.Tensor  # (length_local,) their indices in the whole sequence
    documents: torch.Tensor | None  # (batch, length) packed samples' document of every whole-sequence position
    length: int  # of the whole (padded) sequence
    order: torch.Tensor  # gathered_order: the keys gathered from every rank back in the sequence's order


def split_batch(batch: dict, cp: int, rank: int) -> Slice:
    """This rank's slice of a decoder-only batch, the sequence padded to a multiple of 2 x cp (padding
    carries no label and comes after every real token, which the causal mask keeps it from)."""
    ids, targets = batch["input_ids"], shifted_labels(batch["labels"])
    packed = "position_ids" in batch
    pos = batch["position_ids"] if packed else torch.arange(ids.size(1), device=ids.device).expand_as(ids)
    pad = -ids.size(1) % (2 * cp)
    if pad:
        ids = torch.cat([ids, ids[:, -1:].expand(-1, pad)], dim=1)
        targets = torch.cat([targets, torch.full_like(targets[:, :1], IGNORE).expand(-1, pad)], dim=1)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], dim=1)
    length = ids.size(1)
    mine = local_positions(length, cp, rank, ids.device)
    documents = torch.cumsum(pos == 0, dim=1) if packed else None  # a packed sample starts at position 0
    return Slice(inputs={"input_ids": ids[:, mine], "position_ids": pos[:, mine]}, targets=targets[:, mine],
                 positions=mine, documents=documents, length=length, order=gathered_order(length, cp, ids.device))

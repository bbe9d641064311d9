"""Packing short samples into full sequences for decoder-only models (`--pack`).

Samples are laid end to end, in the dataset's order, into sequences of at most `length` tokens (next
fit: a sample that does not fit the open sequence starts the next one; one longer than `length`, a
prompt and its answer each cut to their own limit, is a sequence of its own). Each packed sequence
keeps the lengths of its parts, from which `collate` makes
position ids that restart at 0 for every part and passes no attention mask: transformers' mask builder
then keeps attention inside each part (masking_utils.find_packed_sequence_indices, read by SDPA, eager
and flex attention alike; flash-attention reads the same position ids), and RoPE or learned positions
see what they would see unpacked. A 4-D block mask would do the same at L x L bytes a sequence.

The caller masks the first label of every part (tokenize.py): packed, it would be predicted from the
previous part's last token; unpacked, a decoder-only model never predicts its first token
(losses.target_tokens). So a packed batch's summed loss and its target count are those of its parts
trained one by one.
"""
from __future__ import annotations

import torch


def bounds(lengths: list[int], length: int) -> list[int]:
    """Where each packed sequence starts among samples of these `lengths` (next fit), then len(lengths)."""
    starts: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if not starts or used + n > length:
            starts.append(i)
            used = 0
        used += n
    return starts + [len(lengths)]


def pack(samples: list[dict], length: int) -> list[dict]:
    """`samples` ({"input_ids", "labels"}, equal lengths) as packed sequences of at most `length` tokens."""
    edges = bounds([len(s["input_ids"]) for s in samples], length)
    return [{"input_ids": [t for s in samples[a:b] for t in s["input_ids"]],
             "labels": [t for s in samples[a:b] for t in s["labels"]],
             "parts": [len(s["input_ids"]) for s in samples[a:b]]} for a, b in zip(edges, edges[1:])]


def positions(parts: list[int], width: int) -> torch.Tensor:
    """Position ids restarting at 0 for each part; the padding after them is a part of its own (its
    tokens attend among themselves, carry no label and are never attended to by a real token)."""
    runs = [torch.arange(n) for n in parts]
    if width > sum(parts):
        runs.append(torch.arange(width - sum(parts)))
    return torch.cat(runs)

"""Attention over the whole sequence for a rank that holds a slice of it.

Each rank keeps its queries and gathers every rank's keys and values (all-gather over the `cp`
group; their gradients summed back in backward). This is the all-gather form of context parallelism
that Llama 3's training used, rather than ring attention: with grouped-query attention the keys and
values are a small part of the activations (8 of 32 heads on Llama-3-8B), one collective per layer
is simpler to overlap than cp-1 ring steps, and it needs no attention kernel that returns its
log-sum-exp (torch's ring path, `context_parallel`, runs on CUDA only, while this one is the same
code on gloo). The cost is the gathered keys and values of one layer at a time: 2 x sequence x
kv_heads x head_dim values.

The function is registered with transformers' attention interface and named in the model's config,
so the model's own attention modules call it (rotary embeddings applied from the global position ids
the slice carries); the model's code is untouched. Outside a split batch (generation) it is the
attention the model had."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .split import Slice

NAME = "bigfit_context_parallel"
# the batch slice under way, (Slice, group): set by the forward of each micro-batch and read again by
# the recompute of its checkpointed blocks in backward, which comes before the next micro-batch's forward
_active: list = [None]


class GatherKeys(torch.autograd.Function):
    """All-gather along the sequence (dim 2 of (batch, heads, seq, dim)) into the whole sequence's
    order; backward sums every rank's gradient of this rank's part (all-reduce on gloo, which has
    no reduce-scatter; reduce-scatter elsewhere)."""

    @staticmethod
    def forward(ctx, x, group, order):
        ctx.group, ctx.order = group, order
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2).index_select(2, order)

    @staticmethod
    def backward(ctx, grad):
        held = torch.empty_like(grad, memory_format=torch.contiguous_format)  # collectives read memory in order
        held.index_copy_(2, ctx.order, grad)  # back to rank after rank
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        if dist.get_backend(ctx.group) == "gloo":
            dist.all_reduce(held, group=ctx.group)
            return held.chunk(size, dim=2)[rank].contiguous(), None, None
        parts = [p.contiguous() for p in held.chunk(size, dim=2)]
        out = torch.empty_like(parts[rank])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None, None


def _chunk_mask(piece: Slice, q: torch.Tensor, end: int):
    """Where the queries at global positions `q` (contiguous, ending at `end`) may attend keys below
    `end`: causally, aligned to the bottom right (torch's CausalBias, which the memory-efficient
    kernel takes without a mask in memory); packed samples also only within their own, a boolean
    mask (batch, 1, len(q), end), as transformers builds for packed batches under SDPA."""
    if piece.documents is None:
        return causal_lower_right(len(q), end)
    keys = torch.arange(end, device=q.device)
    mask = (keys[None, :] <= q[:, None])[None, None]
    if piece.documents is not None:
        docs = piece.documents[:, :end]
        mask = mask & (docs[:, None, None, :] == piece.documents[:, q][:, None, :, None])
    return mask


def _attend(q, k, v, mask, scaling, dropout):
    if k.size(1) != q.size(1):  # grouped-query attention: each key/value head serves several query heads
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)


def context_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: query (batch, heads, local, dim), key/value (batch,
    kv_heads, local, dim) of this rank's tokens. Each of the rank's two chunks attends to the keys
    up to its own end (a causal mask never reaches further), so the work is the chunk's share."""
    piece, group = _active[0]
    k, v = (GatherKeys.apply(t, group, piece.order) for t in (key, value))
    half = query.size(2) // 2
    out = []
    for part, q in zip(query.split(half, dim=2), piece.positions.split(half)):
        end = int(q[-1]) + 1
        out.append(_attend(part, k[:, :, :end], v[:, :, :end], _chunk_mask(piece, q, end), scaling, dropout))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def attend_to(piece: Slice, group) -> None:
    """The model's attention reads `piece` (this rank's slice) from now: through this micro-batch's
    forward and its backward's recomputes, until the next slice."""
    _active[0] = (piece, group)

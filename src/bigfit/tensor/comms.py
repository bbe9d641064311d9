"""The communication units of tensor parallelism that DTensor does not do for us, each an autograd
function whose docstring says what moves in forward and in backward.

The usual ones (all-reduce of a row-parallel output, all-reduce of a column-parallel input's
gradient) are DTensor's, inside torch's ColwiseParallel / RowwiseParallel and styles.py's Conv1D
styles. What is here serves GPT-2's fused c_attn, whose parameter stays a plain contiguous
Shard(1) in Hugging Face's [q | k | v] layout (so that state dicts, optimizer states and DCP
checkpoints are the unparallelised model's) while each rank computes with its own heads."""
from __future__ import annotations

import torch
import torch.distributed as dist


class ReduceGradient(torch.autograd.Function):
    """Enter a column-parallel region by hand. Forward: nothing moves (every rank already holds the
    replicated input). Backward: the input's gradient, which each rank computed from its own
    columns only, is all-reduced over the TP group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # the engine may share the incoming buffer
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumOverGroup(torch.autograd.Function):
    """Leave a row-split region by hand (a vocabulary-parallel embedding's partial lookups). Forward:
    the partial outputs are all-reduced over the TP group. Backward: nothing moves (the output was
    replicated, so every rank already holds its whole gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class HeadLayout:
    """Where the columns of a fused projection of `parts` equal parts (q, k, v: 3), each `width`
    wide and split into `tp` head groups, live in each of two layouts:
    - blocks: the parameter's Shard placement, rank r holding columns [r*n/tp, (r+1)*n/tp);
    - heads: what attention needs, rank r holding group r of every part, [q_r | k_r | v_r].
    The heads of rank r, listed in ascending column order, are exactly [q_r | k_r | v_r], and the
    blocks partition the columns in ascending order: so the all-to-all keeps each rank's columns in
    ascending order both ways and needs one index permutation, here `order`."""

    def __init__(self, parts: int, width: int, group):
        self.group, self.tp, rank = group, dist.get_world_size(group), dist.get_rank(group)
        block, share = parts * width // self.tp, width // self.tp
        heads = [torch.tensor([p * width + r * share + j for p in range(parts) for j in range(share)])
                 for r in range(self.tp)]
        mine = range(rank * block, (rank + 1) * block)
        # to rank r: my block's columns among r's heads (ascending), as local positions in my block
        to = [h[(h >= mine.start) & (h < mine.stop)] - mine.start for h in heads]
        self.order = {"cpu": torch.cat(to)}  # a permutation of my block's positions, grouped by destination
        self.send = [len(t) for t in to]
        # from rank s: the columns of my heads that lie in s's block
        self.recv = [int(((heads[rank] >= s * block) & (heads[rank] < (s + 1) * block)).sum()) for s in range(self.tp)]

    def _order(self, device) -> torch.Tensor:
        """`order` on `device`, copied there once (a copy per forward would wait on the host)."""
        if str(device) not in self.order:
            self.order[str(device)] = self.order["cpu"].to(device)
        return self.order[str(device)]

    def to_heads(self, t: torch.Tensor) -> torch.Tensor:
        rows = t.movedim(-1, 0).index_select(0, self._order(t.device))
        out = rows.new_empty((sum(self.recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows, self.recv, self.send, group=self.group)
        return out.movedim(0, -1).contiguous()

    def to_blocks(self, t: torch.Tensor) -> torch.Tensor:
        rows = t.movedim(-1, 0).contiguous()
        got = rows.new_empty((sum(self.send), *rows.shape[1:]))
        dist.all_to_all_single(got, rows, self.send, self.recv, group=self.group)
        out = torch.empty_like(got).index_copy_(0, self._order(t.device), got)
        return out.movedim(0, -1).contiguous()


class ToHeads(torch.autograd.Function):
    """Fused columns from the blocks layout to the heads layout (HeadLayout), along the last dim.
    Forward: an all-to-all of the tensor: each rank sends the columns of its block that belong to
    other ranks' heads (a third of its block at tp 2, for q, k, v). Backward: the inverse
    all-to-all of the gradient (a permutation: nothing is summed)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
        ctx.layout = layout
        return layout.to_heads(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.layout.to_blocks(grad), None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed token cross-entropy from logits split by vocabulary (Megatron's vocab-parallel loss):
    `local` (tokens, vocab / tp) is this rank's slice, starting at vocabulary row `start`; `labels`
    (tokens,) are global ids, IGNORE (-100) where no loss. No rank ever holds a whole row of logits.
    Forward: three all-reduces of one number per token (the row max, the sum of exponentials, the
    target's logit, which only its owner has). Backward: nothing moves; each rank's slice of the
    gradient is its softmax slice minus the one-hot target, times the incoming gradient.

    Why not torch's `loss_parallel()`: its backward is only right inside the same context, and torch's
    pipeline schedules run the backward where no caller can enter it; this one carries what it needs."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, labels: torch.Tensor, start: int, group) -> torch.Tensor:
        x = local.float()
        row_max = x.amax(-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        probs = (x - row_max[:, None]).exp_()
        sums = probs.sum(-1)
        dist.all_reduce(sums, group=group)
        valid = labels >= 0  # IGNORE is negative
        mine = valid & (labels >= start) & (labels < start + local.size(-1))
        index = torch.where(mine, labels - start, 0)
        target = torch.where(mine, x.gather(1, index[:, None]).squeeze(1), 0.0)
        dist.all_reduce(target, group=group)
        probs.div_(sums[:, None])
        ctx.save_for_backward(probs, index, mine, valid)
        ctx.dtype = local.dtype
        return torch.where(valid, sums.log() + row_max - target, 0.0).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, index, mine, valid = ctx.saved_tensors
        probs.scatter_add_(1, index[:, None], -mine.to(probs.dtype)[:, None])
        probs.mul_(valid.to(probs.dtype)[:, None] * grad)
        return probs.to(ctx.dtype), None, None, None

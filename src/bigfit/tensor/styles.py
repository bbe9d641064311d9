"""ParallelStyles for what torch's ColwiseParallel / RowwiseParallel refuse: Hugging Face's Conv1D
(GPT-2: a linear layer whose weight is stored (in, out)) and GPT-2's fused q/k/v projection.

Every parameter becomes a DTensor on the TP mesh in the unparallelised layout (a plain Shard of
the Hugging Face tensor), so full_tensor(), state dicts, optimizer states and DCP checkpoints
stay in Hugging Face layout and load under any other plan. `src_data_rank` (set by
parallelize_module) None makes each rank cut its shard from its own copy, with no communication:
a rank whose model is on the meta device gets meta shards, to be filled afterwards."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from .comms import HeadLayout, ReduceGradient, SumOverGroup, ToHeads


def _shard_params(module: nn.Module, mesh, placements: dict, src_data_rank) -> None:
    """Each of `module`'s own parameters as a DTensor with placements[name]."""
    for name, param in list(module.named_parameters(recurse=False)):
        dt = distribute_tensor(param.data, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _replicated_input(module, inputs, mesh):
    """Forward: nothing moves (a sequence-parallel input is all-gathered). Backward: DTensor
    all-reduces the input's gradient (each rank's columns contribute part of it), or reduce-scatters
    it by sequence."""
    x = inputs[0]
    x = gathered(x) if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return (x, *inputs[1:])


def gathered(x: DTensor) -> DTensor:
    """`x` replicated, its local tensor contiguous: torch 2.11 all-gathers a sequence split (Shard(1))
    into a strided view, which its DTensor linear then fails to view as a matrix."""
    x = x.redistribute(placements=[Replicate()])
    return x if x.to_local().is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _sharded_input(module, inputs, mesh):
    """Forward and backward: nothing moves; the input is this rank's slice of the last dim."""
    x = inputs[0]
    return (x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(-1)], run_check=False),
            *inputs[1:])


class Conv1DColwise(ParallelStyle):
    """Conv1D split by output features: weight (in, out) Shard(1), bias Shard(0). Forward: nothing
    moves; the output is this rank's slice of the features, a plain tensor. Backward: the input's
    gradient is all-reduced over the TP group."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            _shard_params(mod, mesh, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank)

        return distribute_module(module, device_mesh, partition, _replicated_input,
                                 lambda mod, out, mesh: out.to_local())


class Conv1DRowwise(ParallelStyle):
    """Conv1D split by input features: weight (in, out) Shard(0), bias replicated. Its input is a
    column-parallel layer's local output. Forward: the partial outputs are all-reduced (the bias
    added once), or under sequence parallelism reduce-scattered by sequence (a DTensor Shard(1)).
    Backward: nothing moves (all-gathered by sequence); each rank keeps its slice of the input's
    gradient."""

    def __init__(self, sequence: bool = False):
        super().__init__()
        self.sequence = sequence

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            _shard_params(mod, mesh, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank)

        def output(mod, out, mesh):
            if self.sequence:
                return out.redistribute(placements=[Shard(1)])
            return out.redistribute(placements=[Replicate()]).to_local()

        return distribute_module(module, device_mesh, partition, _sharded_input, output)


class FusedConv1DColwise(ParallelStyle):
    """GPT-2's c_attn: one Conv1D whose output is `parts` projections side by side ([q | k | v],
    or [k | v] for cross-attention), each `width` wide. A contiguous split of its columns would give
    rank 0 all of q; each rank must compute with group r of every part's heads instead.

    The parameters stay a contiguous Shard (Hugging Face layout: see the module docstring) and the
    columns are moved to the heads layout in forward (comms.ToHeads), whichever of the two tensors
    is smaller: the weight (training, where a micro-batch has more tokens than the layer has input
    features) or the output (generation, a few tokens a step). Forward: that all-to-all, nothing
    else. Backward: its inverse, and the all-reduce of the input's gradient (comms.ReduceGradient)."""

    def __init__(self, parts: int, width: int):
        super().__init__()
        self.parts, self.width = parts, width

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _shard_params(module, device_mesh, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank)
        layout = HeadLayout(self.parts, self.width, device_mesh.get_group())
        # an instance attribute shadows Conv1D.forward: the module's class, name and state dict stay
        module.forward = functools.partial(_fused_forward, module, layout)
        return module


def _fused_forward(module: nn.Module, layout: HeadLayout, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight.to_local(), module.bias.to_local()
    rows = ReduceGradient.apply(x.reshape(-1, x.size(-1)), layout.group)
    if rows.size(0) > weight.size(0):  # more tokens than input features: the weight is the smaller to move
        moved = ToHeads.apply(torch.cat([bias[None], weight]), layout)
        out = torch.addmm(moved[0], rows, moved[1:])
    else:
        out = ToHeads.apply(torch.addmm(bias, rows, weight), layout)
    return out.view(*x.shape[:-1], out.size(-1))


class VocabRowwise(ParallelStyle):
    """A token embedding (nn.Embedding) split by vocabulary rows: weight Shard(0). Forward: each rank
    looks up the ids that fall in its rows (zeros for the others) and the partial outputs are
    all-reduced (comms.SumOverGroup), or under sequence parallelism reduce-scattered by sequence
    (a DTensor Shard(1)). Backward: nothing moves (all-gathered by sequence under sequence
    parallelism); the weight's gradient is this rank's rows only.

    Why not torch's RowwiseParallel: DTensor has no row-wise rule for the embedding's backward, so
    it computes the whole (vocab, hidden) gradient, replicated, on every rank: the memory the split
    should save, and a gradient whose placement differs from its parameter's."""

    def __init__(self, sequence: bool = False):
        super().__init__()
        self.sequence = sequence

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _shard_params(module, device_mesh, {"weight": Shard(0)}, self.src_data_rank)
        # an instance attribute shadows Embedding.forward: the module's class, name and state dict stay
        module.forward = functools.partial(_rows_forward, module, device_mesh, self.sequence)
        return module


def _rows_forward(module: nn.Embedding, mesh, sequence: bool, ids: torch.Tensor) -> torch.Tensor:
    weight = module.weight.to_local()  # read at each call: tying and FSDP2 replace the parameter
    rows = weight.size(0)
    start = mesh.get_local_rank() * rows
    mine = (ids >= start) & (ids < start + rows)
    pad = module.padding_idx  # a padding row gets no gradient, on the rank that holds it
    pad = pad - start if pad is not None and 0 <= pad - start < rows else None
    out = F.embedding(torch.where(mine, ids - start, 0), weight, pad).masked_fill(~mine[..., None], 0)
    if sequence:
        return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(placements=[Shard(1)])
    return SumOverGroup.apply(out, mesh.get_group())


class VocabColwise(ParallelStyle):
    """An LM head (nn.Linear, weight (vocab, hidden)) split by vocabulary: weight and bias Shard(0).
    Forward: nothing moves; the logits come out as a DTensor split on their last dim, which
    losses.token_loss takes to comms.VocabParallelCrossEntropy, so no rank holds a whole row. Under
    `whole_logits` (generate(), which reads rows) they are gathered into a plain tensor instead.
    Backward: the input's gradient is all-reduced over the TP group."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            _shard_params(mod, mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank)

        module.whole_logits = False
        return distribute_module(module, device_mesh, partition, _replicated_input,
                                 lambda mod, out, mesh: out.full_tensor() if mod.whole_logits else out)


@contextlib.contextmanager
def whole_logits(model: nn.Module):
    """Whole logits on every rank from a vocabulary-parallel LM head inside (for generate()); a no-op
    for a model without one. Reversible: the head splits its logits again after, also after an error."""
    head = model.get_output_embeddings()
    if getattr(head, "whole_logits", None) is None:
        yield
        return
    head.whole_logits = True
    try:
        yield
    finally:
        head.whole_logits = False


class SplitSequence(ParallelStyle):
    """Enter sequence parallelism after a replicated module (an embedding the vocabulary does not
    split, GPT-2's position embedding): its whole output becomes a DTensor Shard(1), each rank keeping
    its slice of the sequence. Forward: nothing moves. Backward: the slices' gradients are all-gathered."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # a plain hook: distribute_module would make the parameters replicated DTensors
        module.register_forward_hook(lambda mod, args, out: DTensor.from_local(
            out, device_mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)]))
        return module


class GatherSequence(ParallelStyle):
    """Leave sequence parallelism before a module that needs whole sequences (attention, an MLP whose
    inputs enter column-parallel layers, a replicated LM head): every DTensor argument split by
    sequence, positional or keyword, is all-gathered (one already whole is left so). It stays a
    DTensor (`local` False), so that the column-parallel layers' partial input gradients are
    reduce-scattered in backward in one step; or becomes a plain tensor (`local`: a module whose
    input gradient arrives whole on every rank, a replicated head or GPT-2's attention, whose fused
    c_attn all-reduces its own; it is then sliced)."""

    def __init__(self, local: bool = False):
        super().__init__()
        self.local = local

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(x):  # a DTensor argument is the residual stream (split, or already whole)
            if not isinstance(x, DTensor):
                return x
            x = gathered(x)
            return x.to_local() if self.local else x

        def hook(mod, args, kwargs):
            return tuple(gather(a) for a in args), {k: gather(v) for k, v in kwargs.items()}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

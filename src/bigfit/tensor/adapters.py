"""LoRA adapters under tensor parallelism: a plan's style for a layer that peft wrapped moves to its
`base_layer`, and the two adapter matrices are split so that the adapter's output has the base
output's layout, with one small collective more at most (Megatron-style LoRA, as in NeMo):

- column-parallel base (q, k, v, gate, up; GPT-2's c_fc): lora_A (in -> r) replicated, lora_B
  (r -> out) column-parallel. Forward: nothing moves. Backward: lora_B's input gradient (r wide)
  is all-reduced, so every rank's lora_A gets the same whole gradient.
- row-parallel base (o, down, T5's wo; GPT-2's c_proj): lora_A row-parallel on the input's slice,
  its r-wide partial output all-reduced; lora_B replicated. Backward: nothing more moves.
- GPT-2's fused c_attn: lora_B's output columns moved to the heads layout as the base's are
  (FusedLinearColwise).

Replicated adapter matrices stay plain tensors: identical inputs and identical gradients on every
rank of the TP group (the dropout in front of lora_A draws the same mask on each: every rank seeds
alike). Embeddings, the LM head and sequence parallelism keep no adapter (one line, job/checks.py)."""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ..adapters.lora import is_lora_layer
from ..errors import BigfitError
from .comms import HeadLayout, ReduceGradient, ToHeads
from .styles import Conv1DColwise, Conv1DRowwise, FusedConv1DColwise, _shard_params


def with_adapters(model: nn.Module, styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`styles` (module name -> style) for a model that peft may have wrapped: each LoRA layer's
    style on its base layer, plus its adapters' styles. Unchanged for a model without adapters."""
    out = {}
    for name, style in styles.items():
        module = model.get_submodule(name)
        if not is_lora_layer(module):
            out[name] = style
            continue
        out[f"{name}.base_layer"] = style
        for key in module.lora_A:  # the adapter names (bigfit's one: "default")
            out.update(_adapter_styles(name, key, style))
    return out


def _adapter_styles(name: str, key: str, style: ParallelStyle) -> dict[str, ParallelStyle]:
    a, b = f"{name}.lora_A.{key}", f"{name}.lora_B.{key}"
    if isinstance(style, FusedConv1DColwise):
        return {b: FusedLinearColwise(style.parts, style.width)}
    if isinstance(style, Conv1DColwise) or _plain(style, ColwiseParallel):
        return {b: ColwiseParallel()}
    if isinstance(style, Conv1DRowwise) and not style.sequence or _plain(style, RowwiseParallel):
        return {a: RowwiseParallel()}
    raise BigfitError(f"--lora with --tp: the adapter on {name!r} ({type(style).__name__} with its own layouts) "
                      "is not supported; leave the layer out of --lora-targets")


def _plain(style: ParallelStyle, cls: type) -> bool:
    """torch's column- or row-parallel style with its default layouts (a local output split by
    features, or a whole one), not a variant that gathers or reduce-scatters it."""
    if type(style) is not cls:
        return False
    default = cls()
    return (style.input_layouts, style.output_layouts, style.use_local_output) == \
        (default.input_layouts, default.output_layouts, default.use_local_output)


class FusedLinearColwise(ParallelStyle):
    """lora_B of GPT-2's fused c_attn: nn.Linear (r -> parts x width), weight (out, r) a contiguous
    Shard(0) in Hugging Face's [q | k | v] layout, its output columns moved to this rank's heads
    (comms.ToHeads, the base's own layout). Forward: that all-to-all of the output (r is small, the
    output is what moves). Backward: its inverse, and the all-reduce of the input's gradient."""

    def __init__(self, parts: int, width: int):
        super().__init__()
        self.parts, self.width = parts, width

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _shard_params(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank)
        layout = HeadLayout(self.parts, self.width, device_mesh.get_group())
        # an instance attribute shadows Linear.forward: the module's class, name and state dict stay
        module.forward = functools.partial(_fused_forward, module, layout)
        return module


def _fused_forward(module: nn.Linear, layout: HeadLayout, x: torch.Tensor) -> torch.Tensor:
    bias = module.bias.to_local() if module.bias is not None else None
    rows = ReduceGradient.apply(x.reshape(-1, x.size(-1)), layout.group)
    out = ToHeads.apply(torch.nn.functional.linear(rows, module.weight.to_local(), bias), layout)
    return out.view(*x.shape[:-1], out.size(-1))

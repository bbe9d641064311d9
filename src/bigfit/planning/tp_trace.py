"""What tensor parallelism divides of each block, read off the model during the planning trace
(profile.py), from the plan `--tp` applies (tensor/plans.py: q/k/v and FFN-in column-parallel, the
attention output and FFN-out row-parallel; norms replicated; token embeddings and head split by
vocabulary where the degree divides it, counted here as `vocab_rows` and `vocab_params`).

- Parameters: those of the modules the plan splits. Block norms stay whole on every rank.
- Saved activations: a column-parallel layer saves its input, which every TP rank holds whole (under
  sequence parallelism too: the gathered input); a row-parallel one saves its input split. Norms
  save whole tensors. Elsewhere in a block (attention core, activation function, rotary embedding) a
  tensor whose last dim is the hidden size is whole on every rank (residual stream, dropout masks
  after the output projections), any other is a per-head or per-FFN-column piece, split by tp.
  Sequence parallelism splits the norms' and the hidden-sized ones too (`kind` "sp").
- Communication: each row-parallel output is all-reduced in forward; in backward, DTensor
  all-reduces each column-parallel layer's input gradient separately (torch's ColwiseParallel:
  `from_local`'s backward turns the Partial gradient into a Replicate one), so Llama's separate
  q, k, v, gate and up projections reduce five hidden-sized gradients per token, GPT-2's fused
  c_attn and c_fc two. Recorded as elements per token of each block.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import BigfitError


class TensorSplit:
    """Hooks on one traced model: which tensors saved inside blocks TP divides, and per block the
    parameters it splits and the elements per token it all-reduces (forward, backward)."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], hidden: int):
        self.hidden, self.kind, self.error, self.counts = hidden, None, None, {}
        self.params = [0] * len(blocks)
        self.reduce = [[0, 0] for _ in blocks]  # elements per token all-reduced: forward, backward
        self.handles = []
        try:
            styles = _styles(model)
        except BigfitError as e:  # no TP plan for this family: nothing is split (tp 1 only)
            self.error, styles = str(e), {}
        self.vocab_rows, self.vocab_params = _vocab(model)
        names = {id(m): n for n, m in model.named_modules()}
        for i, block in enumerate(blocks):
            for mod in block.modules():
                kind = styles.get(names.get(id(mod))) or ("norm" if "norm" in type(mod).__name__.lower() else None)
                if kind:
                    self._watch(mod, kind)
                if kind in ("colwise", "rowwise"):
                    self._count(i, mod, kind)

    def _watch(self, mod: nn.Module, kind: str) -> None:
        def enter(*_):
            self.kind = kind

        def leave(*_):
            self.kind = None
        self.handles += [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave)]

    def _count(self, i: int, mod: nn.Module, kind: str) -> None:
        self.params[i] += sum(p.numel() for p in mod.parameters(recurse=False))
        features = _features(mod)
        if features:  # an Embedding split by heads (T5's relative bias) sends nothing
            self.reduce[i][0 if kind == "rowwise" else 1] += features[1 if kind == "rowwise" else 0]

    def divides(self, x: torch.Tensor) -> str:
        """What splits this tensor saved for backward (inside a block): "tp" (tensor parallelism),
        "sp" (only sequence parallelism: norms, the residual stream) or "" (nothing)."""
        if self.kind == "colwise":
            return ""
        if self.kind == "norm":
            return "sp"
        if self.kind == "rowwise":
            return "tp"
        return "tp" if x.dim() > 0 and x.shape[-1] != self.hidden else "sp"

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _styles(model: nn.Module) -> dict[str, str]:
    """Module name -> "colwise" / "rowwise", from the plan tensor parallelism applies."""
    # imported here, as in split_counts: torch.distributed.tensor loads when a plan is made, not with the planner
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ..tensor import plans
    from ..tensor.adapters import FusedLinearColwise, with_adapters
    from ..tensor.styles import Conv1DColwise, Conv1DRowwise, FusedConv1DColwise

    out = {}  # LoRA layers: their base layers and adapters, split as tensor/adapters.py splits them
    for name, style in with_adapters(model, plans.build(model).styles).items():
        if isinstance(style, (ColwiseParallel, Conv1DColwise, FusedConv1DColwise, FusedLinearColwise)):
            out[name] = "colwise"
        elif isinstance(style, (RowwiseParallel, Conv1DRowwise)):
            out[name] = "rowwise"
    return out


def _vocab(model: nn.Module) -> tuple[int, int]:
    """(the rows tensor parallelism splits embeddings and head by, or 0; the parameters it divides)."""
    from ..tensor import plans  # imported here, as in split_counts

    rows, head = plans.vocab_rows(model), model.get_output_embeddings()
    split = {id(p): p.numel() for m in [head, *(m for _, m in plans.token_embeddings(model))]
             for p in m.parameters(recurse=False)}
    return rows, sum(split.values()) if rows else 0


def _features(mod: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer: nn.Linear, or Hugging Face's Conv1D (weight (in, out))."""
    if isinstance(mod, nn.Linear):
        return mod.in_features, mod.out_features
    if type(mod).__name__ == "Conv1D":
        return mod.weight.shape[0], mod.nf
    return None


def split_counts(config) -> tuple[dict[str, int], str | None]:
    """What a TP degree must divide (heads, KV heads, FFN width), and why the model has no TP at all."""
    from ..tensor import plans  # imported here: torch.distributed.tensor (and sympy), only when a plan is made

    try:
        return plans.split_counts(config), None
    except BigfitError as e:
        return {}, str(e)


def sequence_error(config) -> str | None:
    """Why sequence parallelism cannot run on this model (tensor/plans.py's check), or None."""
    from ..tensor import plans  # imported here, as in split_counts

    try:
        plans.check(config, 1, sequence=True)
    except BigfitError as e:
        return str(e)
    return None


def valid_tp(counts: dict[str, int]) -> list[int]:
    """The degrees that divide every count (1 alone when the model cannot be split)."""
    g = math.gcd(*counts.values()) if counts else 1
    return [d for d in range(1, g + 1) if g % d == 0]

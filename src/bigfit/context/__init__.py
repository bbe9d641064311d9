"""Context parallelism: each sequence split over the mesh's `cp` ranks, attention over the whole of it.

`apply_context_parallel` names bigfit's attention (attention.py) in the model's config, reversibly;
the engine then runs each decoder-only batch through `ContextParallel.split` (split.py: the rank's
load-balanced slice, labels shifted over the whole sequence), which the attention reads until the next
split. The loss of a slice is its own tokens' sum: the ranks' sums make the sequence's, and the engine
averages gradients over dp x cp (the loop scales by the cp degree)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..errors import BigfitError
from .attention import NAME, attend_to, context_attention
from .split import Slice, split_batch

__all__ = ["ContextParallel", "apply_context_parallel", "check_context_model"]


def check_context_model(config, cp: int, cls: type | None = None) -> None:
    """One line where `config`'s model (of class `cls`, else the one transformers' Auto class builds)
    cannot split its sequences over `cp` ranks (checked before any work starts)."""
    name = getattr(config, "model_type", "the model")
    if getattr(config, "is_encoder_decoder", False):
        raise BigfitError(f"--cp {cp} splits decoder-only sequences; {name} is an encoder-decoder (its cross-attention "
                          "reads the whole encoder output): leave --cp out, or use --tp / --dp-shard")
    if not _takes_attention(config, cls):
        raise BigfitError(f"--cp {cp}: {name}'s attention does not go through transformers' attention interface, "
                          "where bigfit's context-parallel attention plugs in; leave --cp out")


def _takes_attention(config, cls: type | None) -> bool:
    """Whether the model's attention modules call the function its config names (transformers' flag)."""
    if cls is None:
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return bool(getattr(cls, "_supports_attention_backend", False))


class ContextParallel:
    """The `cp` group's view of the model: its attention swapped in while installed."""

    def __init__(self, model: torch.nn.Module, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.configs = _configs(model)
        self.before = [c._attn_implementation for c in self.configs]

    def split(self, batch: dict) -> Slice:
        """This rank's slice of `batch`, which the attention reads from now (through the backward's
        recomputes too) until the next split."""
        piece = split_batch(batch, self.size, self.rank)
        attend_to(piece, self.group)
        return piece

    @contextlib.contextmanager
    def whole(self):
        """The model's own attention inside (generation reads whole sequences on every rank)."""
        self._set(self.before)
        try:
            yield
        finally:
            self._set([NAME] * len(self.configs))

    def remove(self) -> None:
        self._set(self.before)

    def _set(self, names: list[str]) -> None:
        for c, name in zip(self.configs, names):
            c._attn_implementation = name


def _configs(model) -> list:
    """The config objects the model's modules read their attention implementation from."""
    found = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")
             and hasattr(m.config, "_attn_implementation")}
    return list(found.values())


def apply_context_parallel(model: torch.nn.Module, mesh) -> ContextParallel:
    """Install context parallelism over `mesh` (the 1-D `cp` mesh) on an unmodified decoder-only model."""
    check_context_model(model.config, mesh.size(), type(model))
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, context_attention)
    cp = ContextParallel(model, mesh.get_group())
    cp._set([NAME] * len(cp.configs))
    return cp

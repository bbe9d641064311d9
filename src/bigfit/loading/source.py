"""`Weights`: where each tensor this rank stores gets its values, by the tensor's name: a safetensors
checkpoint (parameters, and the buffers it holds) or the seeded init (every tensor of a model built
from its config; the buffers a checkpoint lacks, such as rotary tables, which are not saved).
Names are the unmodified model's: every transform bigfit applies keeps them (FSDP2, tensor
parallelism, pipeline pruning), so a rank asks by the name it sees."""
from __future__ import annotations

import torch

from ..adapters.lora import base_name, is_adapter
from .files import Checkpoint, match
from .init import SeededInit


class Weights:
    """Reads boxes of the tensors of `skeleton` (the model on the meta device, before any transform:
    its names, shapes and ties) from `ckpt`, or makes them by `SeededInit` on `device` when `ckpt` is
    None. Building it checks the checkpoint against the model (one line for a missing parameter or
    a shape that differs), before any storage is allocated."""

    def __init__(self, skeleton: torch.nn.Module, seed: int, device, ckpt: Checkpoint | None = None):
        self.groups = names_by_tensor(skeleton)
        self.first = {name: first for first, names in self.groups.items() for name in names}
        self.ckpt = ckpt
        params = {n for n, _ in skeleton.named_parameters(remove_duplicate=False)}
        self.keys = self._match(skeleton, ckpt, params) if ckpt is not None else {}
        # the init makes what the checkpoint lacks: every tensor without one, LoRA adapters beside one
        self.init = SeededInit(skeleton, seed, device, params=ckpt is None or params - set(self.keys))

    def _match(self, skeleton: torch.nn.Module, ckpt: Checkpoint, params: set[str]) -> dict[str, str]:
        """name -> checkpoint key (`params`: the parameters' names). A LoRA-injected model asks for its
        base weights by the base model's names (lora.base_name); its adapters are not the checkpoint's."""
        shapes = {first: _shape(skeleton, first) for first in self.groups}
        lookup = {first: [base_name(n) for n in names] for first, names in self.groups.items() if not is_adapter(first)}
        real = {base_name(n): n for names in self.groups.values() for n in names}
        found = match(ckpt, lookup, shapes, params, getattr(skeleton, "base_model_prefix", "") or "")
        return {real[name]: key for name, key in found.items()}

    def describe(self) -> str:
        if self.ckpt is None:
            return "weights: random init on each rank (Hugging Face's init, seeded per block), only its own shards"
        return f"weights: each rank reads only its own slices of {self.ckpt.directory}"

    def order(self, name: str) -> int:
        """Tensors filled in this order have each init unit made once (init.py)."""
        return self.init.order(name)

    def read(self, name: str, box: tuple[slice, ...] | None, dtype: torch.dtype, device) -> torch.Tensor:
        """The `box` (one slice per dimension; None: the whole tensor) of tensor `name`, in `dtype` on
        `device`, a tensor of its own (never the init's cached temporary)."""
        key = self.keys.get(name)
        if key is not None:
            t = self.ckpt.read(key, box if box is not None else _whole(self.ckpt.shape(key)))
            return t.to(device=device, dtype=dtype)
        t = self.init.tensor(self.first[name])
        return (t if box is None else t[box]).to(device=device, dtype=dtype, copy=True)


def names_by_tensor(model: torch.nn.Module) -> dict[str, list[str]]:
    """first name -> every name of each parameter and buffer (tied weights have several)."""
    by_id: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(t), []).append(name)
    return {names[0]: names for names in by_id.values()}


def _shape(model: torch.nn.Module, name: str) -> tuple[int, ...]:
    mod_path, _, attr = name.rpartition(".")
    return tuple(getattr(model.get_submodule(mod_path), attr).shape)


def _whole(shape) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)

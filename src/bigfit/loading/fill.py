"""Filling what this rank stores, after the plan's transforms have cut the meta-device model: each
parameter's local part (a DTensor's shard: FSDP2's, tensor parallelism's, both; or the whole tensor)
and every buffer, from `Weights`, one tensor at a time."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..adapters.quantize import is_quantized
from .materialise import to_empty
from .source import Weights


def local_box(t: torch.Tensor) -> tuple[slice, ...]:
    """The global index ranges this rank stores of `t`: a DTensor's shard, by its placements (the
    helper DCP's own planner uses: uneven FSDP2 shards come out unpadded, the last ranks' possibly
    empty), or the whole tensor."""
    if not isinstance(t, DTensor):
        return tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(t.to_local().shape):  # a placement this helper does not describe as a box
        raise NotImplementedError(f"a shard of shape {list(t.to_local().shape)} where its placements "
                                  f"{t.placements} give {list(shape)}")
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def unique_tensors(model: torch.nn.Module):
    """(first name, tensor) for each parameter and buffer, once each."""
    seen = set()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


@torch.no_grad()
def fill(model: torch.nn.Module, weights: Weights, device) -> None:
    """This rank's parts of every tensor of `model` from `weights`; a meta model first gets storage
    on `device` (tied parameters kept tied). A checkpoint gives only the local parts' bytes; the
    seeded init makes one unit's tensors whole at a time on the rank's device, and keeps the parts."""
    if any(t.is_meta for _, t in unique_tensors(model)):
        to_empty(model, device)
    # unit by unit, so the init makes each once (T5 and Llama name the rest's tensors between blocks)
    for name, t in sorted(unique_tensors(model), key=lambda nt: weights.order(nt[0])):
        if is_quantized(t):  # a QLoRA base layer: read and quantized already (adapters/quantize.py)
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        local.copy_(weights.read(name, local_box(t), local.dtype, local.device))


class WholeParams:
    """The offload engine's source of values (offload/placement.py): every parameter whole in fp32
    on the device, and the buffers, read or made on this rank instead of broadcast from the first
    data-parallel rank. Built before the engine replaces the meta parameters, whose names it keeps."""

    def __init__(self, model: torch.nn.Module, weights: Weights, device):
        self.weights, self.device = weights, device
        self.params = {id(t): (name, t) for name, t in unique_tensors(model) if isinstance(t, torch.nn.Parameter)}

    def whole(self, p: torch.Tensor) -> torch.Tensor:
        return self.weights.read(self.params[id(p)][0], None, torch.float32, self.device)

    @torch.no_grad()
    def place_buffers(self, model: torch.nn.Module) -> None:
        for path, mod in model.named_modules():
            for name, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[name] = self.weights.read(f"{path}.{name}" if path else name, None, buf.dtype,
                                                           self.device)

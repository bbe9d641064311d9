"""Storage for a model built on the meta device (`to_empty`, ties kept), and the rank-0 path:
rank 0 holds the whole model and the other ranks get rank 0's values into what they keep (where
each rank cannot fill its own parts, bigfit.loading: `.bin` weights, hub names not cached)."""
from __future__ import annotations

import torch
from torch.distributed import broadcast
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule

from ..adapters.quantize import is_quantized
from ..common.distributed import Runtime
from ..models.source import owners


def to_device(model: torch.nn.Module, device) -> None:
    """Real tensors move; a meta model gets uninitialised storage, to be overwritten from rank 0."""
    if any(p.is_meta for p in model.parameters()):
        to_empty(model, device)
    else:
        model.to(device)


def to_empty(model: torch.nn.Module, device) -> None:
    """`to_empty`, keeping tied parameters tied (it gives each module its own new parameter)."""
    held = owners(model)
    if any(is_quantized(p) for p in model.parameters()):
        if isinstance(model, FSDPModule):  # through FSDP2's _apply, which resets its sharded parameters
            model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
        else:
            _meta_to_empty(model, device)
    else:
        model.to_empty(device=device)  # FSDP2's sharded parameters follow through its _apply hooks
    for refs in held.values():
        first = refs[0][0]._parameters[refs[0][1]]
        for mod, name in refs[1:]:
            mod._parameters[name] = first


def _meta_to_empty(model: torch.nn.Module, device) -> None:
    """Storage for the meta tensors only: a QLoRA base's 4-bit layers are real already (adapters/quantize.py)."""
    for mod in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is not None and t.is_meta:
                    new = torch.empty_like(t, device=device)
                    getattr(mod, kind)[name] = torch.nn.Parameter(new, t.requires_grad) if kind == "_parameters" else new


def materialise_from_rank0(model: torch.nn.Module, full: dict, rt: Runtime, device) -> None:
    """After sharding: ranks whose model was on meta allocate their shards, then every shard and
    buffer is filled from rank 0's full state dict (one broadcast per tensor, each rank keeping its
    shard, FSDP2's or tensor parallelism's), so no rank but 0 ever holds the whole model."""
    if not rt.distributed:
        return
    if any(p.is_meta for p in model.parameters()):
        to_empty(model, device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for _, buf in model.named_buffers():  # non-persistent buffers (rotary tables) are in no state dict
        local = buf.to(rt.device)
        broadcast(local, src=0)
        buf.copy_(local)

"""How the offload engine places an unmodified model: each parameter's fp32 values (from `io`:
read or made on this rank, loading.WholeParams, or rank 0's broadcast, transfer.Transfers), whole on
the device in the compute dtype, this rank's fp32 rows on the host (buckets.py's layout); which
modules' forwards wait for which buckets; states as DTensors for checkpoints."""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard

from ..adapters.quantize import is_quantized
from .buckets import Bucket, local_view


@torch.no_grad()
def materialise(b: Bucket, master: torch.Tensor, io, rank: int, dtype: torch.dtype, held: dict) -> torch.Tensor:
    """Each parameter's fp32 values (`io.whole`): the local rows into the host `master`, the whole
    parameter onto the device in the compute dtype (one parameter at a time on the device)."""
    for s in b.slots:
        full = io.whole(s.param)
        start = rank * s.rows * s.row_numel
        view = local_view(master, s, rank).view(-1)
        view.copy_(full.view(-1)[start:start + view.numel()])
        s.param = _put(s.param, full.to(dtype), held)
    return master


@torch.no_grad()
def place_frozen(model: torch.nn.Module, io, dtype: torch.dtype, held: dict) -> None:
    """Parameters that do not train: on the device in the compute dtype, nothing on the host; a 4-bit
    weight (QLoRA, adapters/quantize.py) is there already."""
    for p in {id(p): p for p in model.parameters() if not p.requires_grad and not is_quantized(p)}.values():
        _put(p, io.whole(p).to(dtype), held)


def _put(p: torch.nn.Parameter, data: torch.Tensor, held: dict) -> torch.nn.Parameter:
    """`data` becomes the parameter's value. A weightless (meta) parameter cannot take real data,
    so a new parameter replaces it in every module that holds it: ties stay ties."""
    if not p.is_meta:
        p.data = data
        return p
    new = torch.nn.Parameter(data, requires_grad=p.requires_grad)
    for mod, name in held[id(p)]:
        mod._parameters[name] = new
    return new


def rows_as_dtensor(flat: torch.Tensor, slot, mesh, rank: int) -> torch.Tensor:
    """This rank's rows of a parameter's state as what DCP saves: a DTensor sharded like Shard(0)."""
    view = local_view(flat, slot, rank)
    if mesh is None:
        return view
    shape = slot.param.shape
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(view, mesh, [Shard(0)], shape=shape, stride=stride, run_check=False)


def scale_rows_as_dtensor(flat: torch.Tensor, slot, seg, mesh, rank: int) -> torch.Tensor:
    """This rank's rows of a parameter's int8 block scales (statefmt.py: `seg.blocks` a row) as what
    DCP saves: a (rows, blocks) tensor sharded like Shard(0), as the parameter's rows are."""
    rows = slot.local_rows(rank)
    view = flat[seg.scale_offset:seg.scale_offset + rows * seg.blocks].view(rows, seg.blocks)
    if mesh is None:
        return view
    total = slot.param.shape[0] if slot.param.dim() else 1
    return DTensor.from_local(view, mesh, [Shard(0)], shape=(total, seg.blocks), stride=(seg.blocks, 1),
                              run_check=False)


def waiting_modules(model, prefixes, bucket_of):
    """(module, buckets) whose forward must wait for the buckets' parameters: each block for its
    own bucket, each other module with parameters of its own for theirs."""
    out, names = [], set(prefixes)
    for name, mod in model.named_modules():
        if name in names:
            ids = {id(p) for p in mod.parameters()}
        elif any(name.startswith(p + ".") for p in prefixes) or not mod._parameters:
            continue
        else:
            ids = {id(p) for p in mod._parameters.values() if p is not None}
        buckets = list({b.index: b for i in ids if (b := bucket_of.get(i)) is not None}.values())
        if buckets:
            out.append((mod, buckets))
    return out

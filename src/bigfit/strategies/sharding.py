"""Data-parallel strategies, DeepSpeed's ZeRO stages on torch.distributed engines:

| strategy      | engine                                   | sharded over ranks                 | in host RAM              |
| ddp           | DDP                                      | nothing                            |                          |
| zero1         | DDP + ZeroRedundancyOptimizer            | optimizer states                   |                          |
| zero2         | FSDP2, reshard_after_forward=False       | optimizer states, gradients (*)    |                          |
| zero3         | FSDP2                                    | + parameters, also between layers  |                          |
| zero3-offload | FSDP2 + CPUOffloadPolicy                 | as zero3                           | + parameters, gradients  |

zero2-offload and zero2-offload-nvme are the offload engine's (offload.py).
zero3-offload without clipping or fp16 loss scaling steps its host optimizer per unit during
backward (streamed.py).
(*) FSDP2 also keeps zero2's parameters sharded between steps; within a step they are gathered once
for forward and kept until backward ends, so no layer is gathered twice: ZeRO-2's communication
and peak, with ZeRO-3's memory at rest.
FSDP2 units: one per transformer block, then the root (embeddings, final norms, head), so tied
weights stay one parameter in the root's group. Mixed precision under FSDP2 is its
MixedPrecisionPolicy (compute copies in bf16/fp16, fp32 sharded master weights, gradients reduced in
`reduce_dtype`); under DDP it is autocast.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ..distributed import Runtime
from ..models import block_lists
from .base import Applied


class FSDPApplied(Applied):
    def generation_context(self):
        @contextlib.contextmanager
        def gathered():
            self.model.unshard()
            try:
                yield
            finally:
                self.model.reshard()

        return gathered()

    def reshard(self) -> None:
        # zero2 keeps parameters gathered from forward until backward; an evaluation has no backward
        for unit in _units(self.model):
            unit.reshard()


def apply_fsdp(model: torch.nn.Module, strategy: str, rt: Runtime, compute: torch.dtype | None,
               reduce: torch.dtype) -> Applied:
    # T5 blocks return their position bias as a view; it is only ever used out of place, which the
    # T5 parity test checks, so FSDP2's warning about in-place use of views is noise here.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    kw = dict(mesh=mesh, reshard_after_forward=strategy.startswith("zero3"),
              mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce if compute else None),
              offload_policy=CPUOffloadPolicy(pin_memory=rt.device.type == "cuda")
              if strategy == "zero3-offload" else OffloadPolicy())
    for _, blocks in block_lists(model):
        for block in blocks:
            fully_shard(block, **kw)
    fully_shard(model, **kw)
    assert isinstance(model, FSDPModule)
    return FSDPApplied(model=model, module=model, strategy=strategy, notes=[f"FSDP2 over {len(list(_units(model)))} units"])


def _units(model):
    return (m for m in model.modules() if isinstance(m, FSDPModule))


class ZeroOneApplied(Applied):
    def make_optimizer(self, cls, **kw):
        return ShardedStateOptimizer(self.model.parameters(), optimizer_class=cls, **kw)


def apply_ddp(model: torch.nn.Module, strategy: str, rt: Runtime, autocast: torch.dtype | None,
              bucket_mb: float) -> Applied:
    ids = [rt.device.index] if rt.device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_mb)
    cls = ZeroOneApplied if strategy == "zero1" else Applied
    return cls(model=wrapped, module=model, strategy=strategy, autocast=autocast)


class ShardedStateOptimizer(ZeroRedundancyOptimizer):
    """ZeRO-1: torch's ZeroRedundancyOptimizer (each rank keeps the states of, and updates, the
    parameters it owns, then broadcasts them), plus a checkpoint format in which every parameter's
    state is saved by its owner alone under the parameter's name (see train/checkpoint.py)."""

    def owned(self):
        """(parameter, its optimizer state) for the parameters this rank owns."""
        mine = {id(p) for g in self.optim.param_groups for p in g["params"]}
        return [(p, self.optim.state[p]) for p in self._all_params if id(p) in mine]

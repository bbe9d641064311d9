"""Data-parallel sharding: DDP (nothing sharded) and ZeRO-3 (parameters, gradients and optimizer
states sharded) built on FSDP2 `fully_shard`, one unit per transformer block plus the root."""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
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


def apply_fsdp(model: torch.nn.Module, rt: Runtime, param_dtype: torch.dtype | None = None) -> Applied:
    """ZeRO-3: shard each block, then the root (embeddings, final norms, head; tied weights stay one
    parameter in the root's group). With bf16 the sharded master weights stay fp32 and gradients
    are reduced in fp32."""
    # T5 blocks return their position bias as a view; it is only ever used out of place, which the
    # T5 parity test checks, so FSDP2's warning about in-place use of views is noise here.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for _, blocks in block_lists(model):
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    assert isinstance(model, FSDPModule)
    return FSDPApplied(model=model, module=model, strategy="zero3")


def apply_ddp(model: torch.nn.Module, rt: Runtime, autocast: torch.dtype | None = None) -> Applied:
    ids = [rt.device.index] if rt.device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=ids)
    return Applied(model=wrapped, module=model, strategy="ddp", autocast=autocast)

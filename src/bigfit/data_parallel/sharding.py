"""Data-parallel strategies, DeepSpeed's ZeRO stages on torch.distributed engines:

| strategy      | engine                                   | sharded over ranks                 | in host RAM              |
| ddp           | DDP                                      | nothing                            |                          |
| zero1         | DDP + ZeroRedundancyOptimizer            | optimizer states                   |                          |
| zero2         | FSDP2, reshard_after_forward=False       | optimizer states, gradients (*)    |                          |
| zero3         | FSDP2                                    | + parameters, also between layers  |                          |
| zero3-offload | FSDP2 + CPUOffloadPolicy                 | as zero3                           | + parameters, gradients  |

zero2-offload and zero2-offload-nvme are the offload engine's (offload/engine.py).
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
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ..adapters.quantize import is_quantized
from ..common.distributed import Runtime
from ..engine.protocol import Applied, trainable
from ..layout.mesh import fsdp_mesh, grad_group
from ..layout.plan import ParallelPlan
from ..models.source import block_lists


class FSDPApplied(Applied):
    def generation_context(self):
        """generate() calls the encoder and the embeddings directly, not through the root forward, so
        parameters that FSDP2 keeps in the root group are gathered for the whole call."""
        @contextlib.contextmanager
        def gathered():
            self.model.unshard()
            try:
                with super(FSDPApplied, self).generation_context():
                    yield
            finally:
                self.model.reshard()

        return gathered()

    def reshard(self) -> None:
        # zero2 keeps parameters gathered from forward until backward; an evaluation has no backward
        for unit in _units(self.model):
            unit.reshard()

    def recover_from_oom(self) -> None:
        """A backward that failed half-way never ran FSDP2's end-of-backward callback (torch queues it on
        the autograd engine, and the error skips it): the units it had reached keep their gathered
        parameters, and every later step mixes their plain gradients with the sharded ones (zero3's
        probe on an H100 after cuBLAS ran out of memory in backward: clip_grad_norm_ "got mixed
        torch.Tensor and DTensor"). Run it as that backward would have, then drop what it reduced."""
        self.model._get_fsdp_state()._root_post_backward_final_callback()  # torch has no public reset
        for p in self.model.parameters():
            p.grad = None
        super().recover_from_oom()


def apply_fsdp(model: torch.nn.Module, plan: ParallelPlan, rt: Runtime, compute: torch.dtype | None,
               reduce: torch.dtype, before=None) -> Applied:
    """FSDP2 units over the data-parallel mesh (tensor-parallel pieces, if any, become 2-D DTensors).
    `before(unit)`, if given, runs on each unit just before it is sharded (QLoRA's quantizer)."""
    # T5 blocks return their position bias as a view; it is only ever used out of place, which the
    # T5 parity test checks, so FSDP2's warning about in-place use of views is noise here.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    shard_units(model, model, fsdp_options(plan, rt, compute, reduce), before)
    assert isinstance(model, FSDPModule)
    return FSDPApplied(model=model, module=model, strategy=plan.name,
                       notes=[f"FSDP2 over {len(list(_units(model)))} units"])


def fsdp_options(plan: ParallelPlan, rt: Runtime, compute: torch.dtype | None, reduce: torch.dtype) -> dict:
    """fully_shard's arguments for the plan: its mesh, ZeRO-2 or 3, mixed precision, host offload."""
    return dict(mesh=fsdp_mesh(rt, plan), reshard_after_forward=plan.zero == 3,
                mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce if compute else None),
                offload_policy=CPUOffloadPolicy(pin_memory=rt.device.type == "cuda")
                if plan.offload_params else OffloadPolicy())


def shard_units(model: torch.nn.Module, root: torch.nn.Module, options: dict, before=None) -> None:
    """One FSDP2 unit per block of `model`, then `root` (the model, or a pipeline stage holding it)."""
    for unit in [b for _, blocks in block_lists(model) for b in blocks] + [root]:
        if before is not None:
            before(unit)
        fully_shard(unit, **options)


def _units(model):
    return (m for m in model.modules() if isinstance(m, FSDPModule))


class ZeroOneStates:
    """ZeRO-1, mixed into an engine whose gradients are averaged before the step (DDP, replicated
    pipeline stages): each rank keeps the optimizer states of the parameters it owns among the ranks
    of `states_group`; checkpoints hold every parameter's state once, saved by its owner under the
    parameter's name."""
    states_group = None  # the data-parallel process group; set on the instance

    def attach_optimizer(self, cls, **kw):
        self.optimizer = ShardedStateOptimizer(trainable(self.model), optimizer_class=cls,
                                               process_group=self.states_group, **kw)

    def checkpoint_state(self, loading: bool = False) -> dict:
        if loading:
            _init_optimizer_state(self.optimizer)
        names = {id(p): n for n, p in self.module.named_parameters()}
        states = {names[id(p)]: dict(st) for p, st in self.optimizer.owned()}
        return {"model": self.saved_model(get_model_state_dict(self.model)), "optim": {"state": states}}

    def after_load(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"], options=self.load_options())  # the states: in place

    def memory_tensors(self) -> dict:
        out = super().memory_tensors()
        out["optimizer"] = [v for st in self.optimizer.optim.state.values() for v in st.values()]
        return out


@dataclass
class ZeroOneApplied(ZeroOneStates, Applied):
    """ZeRO-1 over DDP."""


@torch.no_grad()
def _init_optimizer_state(optimizer) -> None:
    """Create the (lazily built) optimizer states so that a checkpoint can be loaded into them: one
    step on zero gradients with the learning rate at 0 changes no parameter."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in [p for g in optimizer.param_groups for p in g["params"]]:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


def apply_ddp(model: torch.nn.Module, plan: ParallelPlan, rt: Runtime, autocast: torch.dtype | None,
              bucket_mb: float) -> Applied:
    """DDP over the data-parallel ranks (their own group when pipeline ranks share the world), and
    the context-parallel ones beside them."""
    ids = [rt.device.index] if rt.device.type == "cuda" else None
    group = grad_group(rt, plan)
    # a 4-bit base is quantized alike on every rank from one source; DDP's broadcast of it as dense
    # tensors would quantize torchao's NF4 again (other values) and move the whole base for nothing
    four_bit = [n for n, p in model.named_parameters() if is_quantized(p)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, four_bit)
    wrapped = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_mb, process_group=group)
    if plan.zero == 1:
        engine = ZeroOneApplied(model=wrapped, module=model, strategy=plan.name, autocast=autocast)
        engine.states_group = group
        return engine
    return Applied(model=wrapped, module=model, strategy=plan.name, autocast=autocast)


class ShardedStateOptimizer(ZeroRedundancyOptimizer):
    """ZeRO-1: torch's ZeroRedundancyOptimizer (each rank keeps the states of, and updates, the
    parameters it owns, then broadcasts them), plus a checkpoint format in which every parameter's
    state is saved by its owner alone under the parameter's name (see training/checkpoint.py)."""

    def owned(self):
        """(parameter, its optimizer state) for the parameters this rank owns."""
        mine = {id(p) for g in self.optim.param_groups for p in g["params"]}
        return [(p, self.optim.state[p]) for p in self._all_params if id(p) in mine]

"""Tensor parallelism for unmodified Hugging Face models, on DTensor: each transformer block's
attention split by heads and its MLP by FFN width over a 1-D TP mesh; embeddings, norms and LM
heads replicated (plain tensors, tied weights one parameter).

After apply_tensor_parallel the split parameters are DTensors on the TP mesh holding contiguous
shards of the Hugging Face tensors, so `full_tensor()`, `get_model_state_dict(full_state_dict=
True)` and DCP checkpoints are in Hugging Face layout. Every rank of a TP group must run the same
batch through forward (and generate()) in step: each block communicates inside forward and
backward. The logits and the loss come out whole and equal on every rank of the group."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from . import plans

__all__ = ["apply_tensor_parallel", "check_tensor_parallel", "clip_grad_norm", "param_groups"]


def check_tensor_parallel(model_config, tp: int) -> None:
    """Raise BigfitError (one line: the bad degree, what it fails to divide, the valid degrees) when
    `tp` cannot split this model, or when its model type has no plan. Reads the config only."""
    plans.check(model_config, tp)


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh) -> list[str]:
    """Split every block's attention and MLP over the 1-D DeviceMesh `tp_mesh`, in place; returns
    notes for the start-of-run table. No communication: each rank cuts its shards from its own
    copy (src_data_rank None), so ranks whose model is on the meta device get meta shards, to be
    filled afterwards (set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)).
    A mesh of one rank changes nothing."""
    tp = tp_mesh.size()
    check_tensor_parallel(model.config, tp)
    if tp == 1:
        return []
    plan = plans.build(model)
    parallelize_module(model, tp_mesh, plan.styles, src_data_rank=None)
    for module, names in plan.local:  # attention code that reads head counts sees this rank's
        for name in names:
            setattr(module, name, getattr(module, name) // tp)
    return [f"tensor parallel {tp}: {plan.blocks} (attention heads and FFN split); embeddings and LM head replicated"]


def param_groups(params) -> list[dict]:
    """`params` as optimizer parameter groups, one per kind: plain tensors, then DTensors of each
    mesh. torch's fused and foreach optimizers run one kernel per group, and refuse a group that
    mixes plain tensors with DTensors, or DTensors of two meshes (FSDP2 over TP: split parameters on
    the 2-D mesh, replicated ones on the data-parallel mesh alone)."""
    groups = defaultdict(list)
    for p in params:
        groups[p.device_mesh if isinstance(p, DTensor) else None].append(p)
    return [{"params": ps} for ps in groups.values()]

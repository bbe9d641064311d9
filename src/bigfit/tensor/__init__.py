"""Tensor parallelism for unmodified Hugging Face models, on DTensor: each transformer block's
attention split by heads and its MLP by FFN width over a 1-D TP mesh; token embeddings and the LM
head split by vocabulary where the degree divides it (replicated otherwise), norms replicated; tied
weights stay one parameter. With `sequence` (Megatron's sequence parallelism) the residual stream
between attention and MLP is a DTensor split by sequence, and the norms run on each rank's tokens.

After apply_tensor_parallel the split parameters are DTensors on the TP mesh holding contiguous
shards of the Hugging Face tensors, so `full_tensor()`, `get_model_state_dict(full_state_dict=
True)` and DCP checkpoints are in Hugging Face layout. Every rank of a TP group must run the same
batch through forward (and generate()) in step: each block communicates inside forward and
backward. The loss comes out whole and equal on every rank of the group; the logits come out split
by vocabulary (a DTensor, which losses.token_loss takes), or whole under `whole_logits`."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from . import plans
from .adapters import with_adapters
from .styles import whole_logits

__all__ = ["apply_tensor_parallel", "check_tensor_parallel", "param_groups", "whole_logits"]


def check_tensor_parallel(model_config, tp: int, sequence: bool = False) -> None:
    """Raise BigfitError (one line: the bad degree, what it fails to divide, the valid degrees) when
    `tp` cannot split this model, or when its model type has no plan (or, with `sequence`, none that
    sequence parallelism supports). Reads the config only."""
    plans.check(model_config, tp, sequence)


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh, sequence: bool = False) -> list[str]:
    """Split every block's attention and MLP over the 1-D DeviceMesh `tp_mesh`, in place; returns
    notes for the start-of-run table. No communication: each rank cuts its shards from its own
    copy (src_data_rank None), so ranks whose model is on the meta device get meta shards, to be
    filled afterwards: by each rank from its slices (bigfit.loading), or on the rank-0 path by
    set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True).
    A mesh of one rank changes nothing. `sequence`: Megatron's sequence parallelism (plans.py). LoRA
    layers (peft's, injected before) keep their base layer's split and split their adapters to match
    (adapters.py)."""
    tp = tp_mesh.size()
    check_tensor_parallel(model.config, tp, sequence)
    if tp == 1:
        return []
    plan, vocab = plans.build(model, sequence), plans.vocab_styles(model, tp, sequence)
    ties = _ties(model)
    parallelize_module(model, tp_mesh, with_adapters(model, {**plan.styles, **vocab}), src_data_rank=None)
    _retie(ties)
    for module, names in plan.local:  # attention code that reads head counts sees this rank's
        for name in names:
            setattr(module, name, getattr(module, name) // tp)
    split = "split by vocabulary" if plans.splits_vocab(plans.vocab_rows(model), tp) else \
        f"replicated ({model.config.vocab_size} rows do not split {tp} ways)"
    seq = "; residual stream and norms split by sequence" if sequence else ""
    return [f"tensor parallel {tp}: {plan.blocks} (attention heads and FFN split); embeddings and LM head {split}{seq}"]


def _ties(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """Each parameter held by several modules (tied embeddings), as its (module, attribute) holders."""
    holders = defaultdict(list)
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            holders[id(p)].append((mod, name))
    return [h for h in holders.values() if len(h) > 1]


def _retie(ties) -> None:
    """Each style shards its own module's copy of a tied weight: make the first holder's the one."""
    for (first, name), *rest in ties:
        for mod, attr in rest:
            setattr(mod, attr, getattr(first, name))


def param_groups(params) -> list[dict]:
    """`params` as optimizer parameter groups, one per kind: plain tensors, then DTensors of each
    mesh. torch's fused and foreach optimizers run one kernel per group, and refuse a group that
    mixes plain tensors with DTensors, or DTensors of two meshes (FSDP2 over TP: split parameters on
    the 2-D mesh, replicated ones on the data-parallel mesh alone)."""
    groups = defaultdict(list)
    for p in params:
        groups[p.device_mesh if isinstance(p, DTensor) else None].append(p)
    return [{"params": ps} for ps in groups.values()]

"""Per-rank loading: every rank builds the model on the meta device, the plan's transforms cut it,
and each rank fills only what it stores, reading its slices of the safetensors weights
(files.py) or making them by Hugging Face's init seeded per block (init.py), so no process ever
holds the whole model and no rank waits for rank 0's broadcasts.

Where it applies (parallel/apply.py): one process, DDP / ZeRO-1 replicas, FSDP2 (zero2, zero3,
zero3-offload, HSDP), tensor parallelism and FSDP2 x TP, the offload engine (zero2-offload(-nvme):
whole parameters on the device, this rank's fp32 rows on the host), pipeline stages (each rank
its stages only) and device maps (one process: each module's tensors read or made straight on the
device the map gives it, so the host holds only the blocks placed there). The rank-0 path (rank 0
builds the whole model on its CPU, the others receive their parts) stays for `.bin` checkpoints,
hub names not in the local cache and models handed to `apply` with real weights.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ..models.source import ModelSource, build_model, locate
from .files import Checkpoint, safetensors_dir
from .fill import WholeParams, fill, local_box
from .source import Weights

__all__ = ["Checkpoint", "Weights", "WholeParams", "check_weights", "fill", "init_whole", "loads_per_rank",
           "local_box", "weights_for"]


def loads_per_rank(src: ModelSource) -> bool:
    """Whether every rank builds on the meta device and fills its own storage (the training loop
    builds the model that way when this says so)."""
    return src.kind in ("default", "config") or safetensors_dir(src) is not None


def weights_for(model: torch.nn.Module, cfg, rt) -> Weights | None:
    """This rank's `Weights` for `model` (the meta-device model before any transform), or None for
    the rank-0 path. Ranks agree (one all-reduce): a model with real weights on any rank means
    those weights are the ones to spread."""
    ok = all(t.is_meta for t in [*model.parameters(), *model.buffers()]) and loads_per_rank(locate(cfg.model))
    if rt.distributed:
        flag = torch.tensor([int(ok)], device=rt.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    if not ok:
        return None
    directory = safetensors_dir(locate(cfg.model))
    return Weights(copy.deepcopy(model), cfg.seed, rt.device, Checkpoint(directory) if directory else None)


def init_whole(model: torch.nn.Module, seed: int, device) -> None:
    """Fill a meta-device model whole in host RAM with the seeded init made on `device` (the device
    the per-rank strategies initialise on: their values, bit for bit): a reference to compare with."""
    fill(model, Weights(copy.deepcopy(model), seed, device, None), "cpu")


def check_weights(src: ModelSource, model_config) -> None:
    """The safetensors files against the model (every parameter there, every shape equal), before
    any process starts: one line naming the tensor and the file, else nothing."""
    directory = safetensors_dir(src)
    if directory is None:
        return
    Weights(build_model(src, model_config, 0, on_meta=True), 0, "cpu", Checkpoint(directory))

"""Strategies: post-construction transforms of an unmodified model.

`apply_strategy` is the one place where they are applied, always in this order (torchtitan's):
    split (device map / pipeline stages) -> tensor parallel -> activation checkpointing
    -> compile -> sharding (DDP / ZeRO via FSDP2) -> offload
The split by a device map is bigfit.device_map (one process drives every device); the split into
pipeline stages across processes is bigfit.pipeline; compile is per block (compiling.py);
tensor parallelism is later work and slots into its place here.
"""
from __future__ import annotations

import os

import torch

from ..distributed import Runtime
from ..precision import DTYPES, compute_dtype
from .base import Applied, local
from .checkpointing import apply_activation_checkpointing
from .compiling import apply_compile
from .offload import apply_offload
from .placement import owners
from .sharding import apply_ddp, apply_fsdp
from .streamed import stream_host_steps

__all__ = ["FSDP_STRATEGIES", "OFFLOAD_STRATEGIES", "Applied", "apply_strategy", "build_optimizer", "local"]

# Strategies built on FSDP2; they run on a one-rank mesh too (offload and parameter casting need it).
FSDP_STRATEGIES = ("zero2", "zero3", "zero3-offload")
# Strategies run by bigfit's offload engine (offload.py)
OFFLOAD_STRATEGIES = ("zero2-offload", "zero2-offload-nvme")


def apply_strategy(model: torch.nn.Module, cfg, rt: Runtime) -> Applied:
    """Checkpoint, shard and place `model` as `cfg.strategy` / `cfg.precision` say. Rank 0 brings the
    real weights; other ranks may bring a meta-device model, which gets rank 0's weights here."""
    compute = compute_dtype(cfg.precision)
    if cfg.strategy == "device_map":  # split first, then checkpointing of the placed blocks
        from ..device_map.strategy import apply_device_map

        applied = apply_device_map(model, cfg, rt)
        applied.notes += _per_block(model, cfg)
        return applied
    if cfg.strategy == "pipeline":  # split first: checkpointing then wraps only this rank's blocks
        from ..pipeline import apply_pipeline

        applied = apply_pipeline(model, cfg, rt)
        applied.notes += _per_block(model, cfg)
        return applied
    notes = _per_block(model, cfg)
    eager = cfg.max_grad_norm <= 0 and cfg.precision != "fp16"  # no global norm needed before a host step
    if cfg.strategy in FSDP_STRATEGIES:
        full = model.state_dict() if rt.is_main else {}  # references, not copies
        applied = apply_fsdp(model, cfg.strategy, rt, compute, DTYPES[cfg.reduce_dtype])
        # zero3-offload's shards live in host RAM; FSDP2 copies them to the device for compute
        materialise_from_rank0(model, full, rt, "cpu" if cfg.strategy == "zero3-offload" else rt.device)
        if cfg.strategy == "zero3-offload" and eager:
            applied = stream_host_steps(applied, rt.device)
    elif cfg.strategy in OFFLOAD_STRATEGIES:
        applied = apply_offload(model, cfg.strategy, rt, compute, delayed=cfg.delayed_update, nvme_dir=_nvme_dir(cfg),
                                eager=eager,
                                nvme_host_bytes=cfg.nvme_host_gb * 1e9 / _local_ranks(),
                                grads_on_device=cfg.offload_grads == "device")
    elif cfg.strategy in ("ddp", "zero1") and rt.distributed:
        _to(model, rt.device)
        applied = apply_ddp(model, cfg.strategy, rt, compute, cfg.ddp_bucket_mb)  # DDP broadcasts rank 0's
    else:  # one process, nothing to shard or reduce
        applied = Applied(model=model.to(rt.device), module=model, strategy=cfg.strategy, autocast=compute)
    applied.notes[:0] = notes
    return applied


def _per_block(model: torch.nn.Module, cfg) -> list[str]:
    """Activation checkpointing, then compile, of each block (after the split, before sharding)."""
    notes = []
    if cfg.activation_checkpointing:
        notes.append(f"activation checkpointing on {apply_activation_checkpointing(model)} blocks")
    if cfg.compile:
        notes.append(f"torch.compile ({cfg.compile_backend}) on {apply_compile(model, cfg.compile_backend)} blocks")
    return notes


def _to(model: torch.nn.Module, device) -> None:
    """Real tensors move; a meta model gets uninitialised storage, to be overwritten from rank 0."""
    if any(p.is_meta for p in model.parameters()):
        _to_empty(model, device)
    else:
        model.to(device)


def _to_empty(model: torch.nn.Module, device) -> None:
    """`to_empty`, keeping tied parameters tied (it gives each module its own new parameter)."""
    held = owners(model)
    model.to_empty(device=device)
    for refs in held.values():
        first = refs[0][0]._parameters[refs[0][1]]
        for mod, name in refs[1:]:
            mod._parameters[name] = first


def materialise_from_rank0(model: torch.nn.Module, full: dict, rt: Runtime, device) -> None:
    """After sharding: ranks whose model was on meta allocate their shards, then every shard and
    buffer is filled from rank 0's full state dict (one broadcast per tensor, each rank keeping its
    shard), so no rank but 0 ever holds the whole model."""
    if not rt.distributed:
        return
    from torch.distributed import broadcast
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(p.is_meta for p in model.parameters()):
        _to_empty(model, device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for _, buf in model.named_buffers():  # non-persistent buffers (rotary tables) are in no state dict
        local = buf.to(rt.device)
        broadcast(local, src=0)
        buf.copy_(local)


def build_optimizer(applied: Applied, cfg) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay) or Adam (L2), placed where the strategy keeps its states."""
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    # torch's fused kernels (CUDA and CPU): on the GPU machine the multi-tensor loop made the host-side
    # step of zero3-offload 4.5x slower than FSDP2's own offload with fused AdamW (benchmarks/RESULTS.md)
    return applied.make_optimizer(cls, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay, fused=True)


def _local_ranks() -> int:
    """The node's ranks share its host RAM budget (--nvme-host-gb is per node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _nvme_dir(cfg) -> str | None:
    """zero2-offload-nvme: one directory per rank (each keeps only its own rows' states)."""
    if cfg.strategy != "zero2-offload-nvme":
        return None
    return os.path.join(cfg.nvme_dir or os.path.join(cfg.output_dir, "nvme"), f"rank-{os.environ.get('RANK', '0')}")

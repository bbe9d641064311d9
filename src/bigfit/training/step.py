"""One optimizer step over a rank's micro-batches, normalised so that the result does not depend on
how the global batch was split.

Each micro-batch contributes its summed token loss divided by the token count of the WHOLE global
batch (all ranks), times the number of data-parallel ranks because DDP and FSDP average gradients
over them (pipeline and tensor-parallel peers share a data shard: layout/mesh.py's data view). The
gradients are then exactly those of the token-mean loss of the global batch, whatever the layout
or the number of micro-batches, and so is the logged loss. The loop talks to the engine only
through engine/protocol.py's `Engine` protocol.
"""
from __future__ import annotations

import math

import torch

from ..common.distributed import Runtime, all_reduce_sum
from ..common.precision import LossScaler
from ..data import collate
from ..engine import Engine
from ..engine.losses import sample_targets, target_tokens


def global_targets(samples: list[dict], seq2seq: bool) -> int:
    """The target tokens of a step's whole global batch, counted on the host from its samples (every
    rank holds the dataset and the batch order is a function of the step: data/batches.py)."""
    return sum(sample_targets(s, seq2seq) for s in samples)


def lr_at(step: int, cfg) -> float:
    """Warm-up from warmup_min_lr to lr (linear, or log as DeepSpeed's WarmupLR), then linear or
    cosine decay to min_lr at max_steps, or constant. A pure function of the step: resuming needs no
    scheduler state."""
    peak, warm, total = cfg.lr, cfg.warmup_steps, cfg.max_steps
    if warm and step < warm:
        if cfg.warmup_type == "log":  # DeepSpeed's: reaches the peak at the last warm-up step
            frac = math.log(step + 1) / math.log(warm) if warm > 1 else 1.0
        else:
            frac = (step + 1) / warm
        return cfg.warmup_min_lr + (peak - cfg.warmup_min_lr) * frac
    if cfg.lr_schedule == "constant":
        return peak
    progress = min(1.0, (step - warm) / max(1, total - warm))
    left = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
    return cfg.min_lr + (peak - cfg.min_lr) * left


def train_step(engine: Engine, micro_batches: list[list[dict]], *, pad_id: int, seq2seq: bool, rt: Runtime,
               lr: float, max_grad_norm: float, scaler: LossScaler | None = None,
               total_tokens: int | None = None) -> dict:
    """Forward/backward every micro-batch, unscale, clip, step (or skip an fp16 overflow).
    Returns the global-batch loss and what happened. `total_tokens`: the global batch's target tokens
    where the caller counted them (the loop knows every rank's samples: `global_targets`); else they
    are summed over the ranks, a collective and a device sync before the first forward."""
    host = [collate(mb, pad_id, multiple=engine.sequence_multiple) for mb in micro_batches]
    batches = [{k: v.to(rt.device, non_blocking=True) for k, v in b.items()} for b in host]
    data = rt.data  # the ranks the global batch is divided over
    if total_tokens is None:
        local_tokens = sum(target_tokens(b["labels"], seq2seq) for b in host)  # counted on the host
        total_tokens, = all_reduce_sum([local_tokens], data)
    loss_scale = scaler.scale if scaler else 1.0
    # DDP and FSDP2 average over the data-parallel ranks and the context-parallel ones, whose losses are
    # each the sum over their slice of the sequences
    factor = loss_scale * data.world_size * engine.context_ranks / max(total_tokens, 1.0)
    local_loss = torch.zeros((), dtype=torch.float64, device=rt.device)
    engine.set_lr(lr)
    for i, batch in enumerate(batches):
        local_loss += engine.run_batch(batch, seq2seq, factor, sync=i == len(batches) - 1)  # summed on the device
    grad_norm = engine.update(max_grad_norm, loss_scale)
    overflow = not math.isfinite(grad_norm)  # the norm is global: every rank skips the same steps
    total_loss, = all_reduce_sum([local_loss.item() if engine.counts else 0.0], rt)  # each shard's once
    out = {"loss": total_loss / max(total_tokens, 1.0), "tokens": int(total_tokens), "grad_norm": grad_norm, "lr": lr}
    if scaler:
        scaler.update(overflow)
        out.update(loss_scale=loss_scale, overflow=overflow, skipped_steps=scaler.overflows)
    return out

"""One optimizer step over a rank's micro-batches, normalised so that the result does not depend on
how the global batch was split.

Each micro-batch contributes its summed token loss divided by the token count of the WHOLE global
batch (all ranks), times the world size because DDP and FSDP average gradients over ranks. The
gradients are then exactly those of the token-mean loss of the global batch, whatever the number
of processes or micro-batches, and so is the logged loss.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..data import collate
from ..distributed import Runtime, all_reduce_sum
from ..data.tokenize import IGNORE
from ..precision import LossScaler
from ..strategies import Applied


def loss_sum(applied: Applied, batch: dict, seq2seq: bool) -> torch.Tensor:
    """Summed token cross-entropy of one forward pass; `target_tokens` counts the tokens it covers."""
    labels = batch["labels"]
    with applied.forward_context():
        if seq2seq:
            dec_in = applied.module.prepare_decoder_input_ids_from_labels(labels=labels)
            logits = applied.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   decoder_input_ids=dec_in, use_cache=False).logits
        else:
            logits = applied.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   use_cache=False).logits
    return token_loss(logits, labels, seq2seq)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, seq2seq: bool) -> torch.Tensor:
    """Summed token cross-entropy in fp32, from the logits (some models compute their own loss in
    the low-precision compute dtype). A decoder-only model predicts position t+1 from t. Pipeline
    stages compute this same loss on their last stage."""
    if not seq2seq:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def _chunked_loss_sum(applied: Applied, batch: dict, seq2seq: bool) -> torch.Tensor:
    """`loss_sum`; under device_map with --chunks, the sum over GPipe micro-batches run by
    device_map.pipeline (a summed token loss needs no reweighting across chunks), which the caller
    backpropagates in one call (the pipeline's backward order needs it). Under autocast each weight
    is cast once for all chunks (device_map/casts.py)."""
    chunks = getattr(applied, "chunks", 1)
    if chunks == 1:
        return loss_sum(applied, batch, seq2seq)
    from ..device_map import cast_once, run_chunks, split_batch

    with cast_once(applied.model, enabled=applied.autocast is not None):  # each call enters autocast itself
        return sum(run_chunks(lambda part: loss_sum(applied, part, seq2seq), split_batch(batch, chunks), applied.main,
                              ordered_backward=True))


def target_tokens(labels: torch.Tensor, seq2seq: bool) -> int:
    """Tokens that carry loss: a decoder-only model predicts position t+1 from t, so its first label
    is never a target."""
    return int(((labels if seq2seq else labels[:, 1:]) != IGNORE).sum())


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


def train_step(applied: Applied, optimizer, micro_batches: list[list[dict]], *, pad_id: int, seq2seq: bool,
               rt: Runtime, lr: float, max_grad_norm: float, scaler: LossScaler | None = None) -> dict:
    """Forward/backward every micro-batch, unscale, clip, step (or skip an fp16 overflow).
    Returns the global-batch loss and what happened."""
    host = [collate(mb, pad_id) for mb in micro_batches]
    local_tokens = sum(target_tokens(b["labels"], seq2seq) for b in host)  # counted on the host: no device sync
    batches = [{k: v.to(rt.device) for k, v in b.items()} for b in host]
    data = applied.data_runtime(rt)  # the ranks the global batch is divided over
    total_tokens, = all_reduce_sum([local_tokens], data)
    loss_scale = scaler.scale if scaler else 1.0
    factor = loss_scale * data.world_size / max(total_tokens, 1.0)
    local_loss = torch.zeros((), dtype=torch.float64, device=rt.device)
    for group in optimizer.param_groups:  # before backward: the offload engine may step during it
        group["lr"] = lr
    for i, batch in enumerate(batches):
        if hasattr(applied, "run_batch"):  # pipeline stages: forward and backward inside the schedule
            loss = applied.run_batch(batch, seq2seq, factor)
        else:
            with applied.accumulation_context(sync=i == len(batches) - 1):
                loss = _chunked_loss_sum(applied, batch, seq2seq)
                (loss * factor).backward()
        local_loss += loss.detach()  # summed on the device: one sync per step, not per micro-batch
    grad_norm = _update(applied, optimizer, max_grad_norm, loss_scale)
    overflow = not math.isfinite(grad_norm)  # the norm is global: every rank skips the same steps
    total_loss, = all_reduce_sum([local_loss.item()], rt)  # pipeline: only the last stage's rank has it
    out = {"loss": total_loss / max(total_tokens, 1.0), "tokens": int(total_tokens), "grad_norm": grad_norm, "lr": lr}
    if scaler:
        scaler.update(overflow)
        out.update(loss_scale=loss_scale, overflow=overflow, skipped_steps=scaler.overflows)
    return out


def _update(applied: Applied, optimizer, max_norm: float, loss_scale: float) -> float:
    """Unscale, clip and step, unless the gradients overflowed; returns the global gradient norm."""
    if hasattr(optimizer, "clip_and_step"):  # the offload engine unscales and clips inside its host step
        return optimizer.clip_and_step(max_norm, loss_scale)
    applied.finish_backward()
    params = [p for p in applied.model.parameters() if p.grad is not None]
    if loss_scale != 1.0:
        for p in params:
            p.grad.div_(loss_scale)
    grad_norm = applied.clip_grad_norm(params, max_norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm

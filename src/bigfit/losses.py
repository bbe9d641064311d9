"""The training loss every strategy computes: summed token cross-entropy from fp32 logits. Below the
strategies and the loop, so that pipeline stages, device maps and the loop compute the same thing."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .data.tokenize import IGNORE


def model_logits(model: torch.nn.Module, module: torch.nn.Module, batch: dict, seq2seq: bool) -> torch.Tensor:
    """The logits of one forward pass of `model` (a wrapper of `module`, the Hugging Face model)."""
    if seq2seq:
        dec_in = module.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     decoder_input_ids=dec_in, use_cache=False).logits
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits


def token_loss(logits: torch.Tensor, labels: torch.Tensor, seq2seq: bool) -> torch.Tensor:
    """Summed token cross-entropy in fp32, from the logits (some models compute their own loss in
    the low-precision compute dtype). A decoder-only model predicts position t+1 from t."""
    if not seq2seq:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def target_tokens(labels: torch.Tensor, seq2seq: bool) -> int:
    """Tokens that carry loss: a decoder-only model predicts position t+1 from t, so its first label
    is never a target."""
    return int(((labels if seq2seq else labels[:, 1:]) != IGNORE).sum())

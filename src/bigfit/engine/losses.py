"""The training loss every strategy computes: summed token cross-entropy from fp32 logits. Below the
strategies and the loop, so that pipeline stages, device maps and the loop compute the same thing."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ..data.tokenize import IGNORE
from ..tensor.comms import VocabParallelCrossEntropy


def model_logits(model: torch.nn.Module, module: torch.nn.Module, batch: dict, seq2seq: bool) -> torch.Tensor:
    """The logits of one forward pass of `model` (a wrapper of `module`, the Hugging Face model). A
    packed batch (data/pack.py) gives position ids instead of a mask: the model keeps attention within
    each packed sample from them."""
    if "position_ids" in batch:
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    if seq2seq:
        dec_in = module.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     decoder_input_ids=dec_in, use_cache=False).logits
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits


def token_loss(logits: torch.Tensor, labels: torch.Tensor, seq2seq: bool, shifted: bool = False) -> torch.Tensor:
    """Summed token cross-entropy in fp32, from the logits (some models compute their own loss in
    the low-precision compute dtype). A decoder-only model predicts position t+1 from t (`shifted`:
    the labels are already each position's target, as a sequence cut into slices or chunks needs).
    Logits split by vocabulary (a tensor-parallel LM head's DTensor) go to the vocabulary-parallel loss."""
    seq2seq = seq2seq or shifted  # nothing left to shift
    if isinstance(logits, DTensor):
        return _vocab_parallel_loss(logits, labels, seq2seq)
    if not seq2seq:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def _vocab_parallel_loss(logits: DTensor, labels: torch.Tensor, seq2seq: bool) -> torch.Tensor:
    local, mesh = logits.to_local(), logits.device_mesh  # (batch, seq, vocab / tp), Shard(-1)
    if not seq2seq:
        local, labels = local[:, :-1], labels[:, 1:]
    start = mesh.get_local_rank() * local.size(-1)
    return VocabParallelCrossEntropy.apply(local.flatten(0, 1), labels.flatten(), start, mesh.get_group())


def sample_targets(sample: dict, seq2seq: bool) -> int:
    """`target_tokens` of one uncollated sample (its labels a list): what padding leaves unchanged."""
    labels = sample["labels"] if seq2seq else sample["labels"][1:]
    return sum(1 for x in labels if x != IGNORE)


def target_tokens(labels: torch.Tensor, seq2seq: bool) -> int:
    """Tokens that carry loss: a decoder-only model predicts position t+1 from t, so its first label
    is never a target."""
    return int(((labels if seq2seq else labels[:, 1:]) != IGNORE).sum())

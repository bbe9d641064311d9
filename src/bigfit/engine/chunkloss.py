"""The LM head and its loss in chunks of tokens, so that no step holds the whole logits.

A decoder's logits are tokens x vocabulary: at 65,536 tokens and Llama-3's 128,256 words, 16.8 GB in
bf16 and twice that in fp32, more than every other activation of the step. Here the model's output
head computes the summed token loss itself, a chunk of tokens at a time, each chunk under
torch.utils.checkpoint: forward keeps no chunk's logits, and backward makes one chunk's again
(the head's matmul twice: about 2 x hidden x vocabulary flops a token) and frees it before the next.

Why not Liger's fused linear cross-entropy or Apple's cut-cross-entropy: both take the head's weight
as a plain tensor and compute its gradient themselves, which a vocabulary-split DTensor (tensor
parallelism), FSDP2's gathered weight and the offload engine's gradient hooks each need to see
through autograd; the head's own forward, run per chunk, keeps every engine's path as it is.

Installed as an instance attribute over the head's `forward` (reversible, the module's hooks kept:
tensor parallelism's input and output hooks still run around it); it computes the loss only inside
`computing(targets)`, else it is the head it was."""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.utils.checkpoint import checkpoint

from ..layout.activations import loss_chunk_tokens
from .losses import token_loss


class ChunkedHead:
    """The model's output head, computing the loss of a micro-batch in chunks while `targets` are set."""

    def __init__(self, head: torch.nn.Module, setting: int | None, vocab: int):
        self.head, self.setting, self.vocab = head, setting, vocab
        self.now = threading.local()  # (targets, tokens) of the micro-batch under way on this thread: a
        # device map's GPipe chunks run on threads of their own, at once
        self.forward, self.shadowed = head.forward, "forward" in head.__dict__  # another hook's (a device map's)
        head.forward = functools.partial(ChunkedHead._call, self)

    def tokens_for(self, tokens: int) -> int:
        """Tokens per chunk for a micro-batch of `tokens` (this rank's); 0: the whole logits at once."""
        return loss_chunk_tokens(self.setting, tokens, self.vocab)

    @contextlib.contextmanager
    def computing(self, targets: torch.Tensor, tokens: int):
        """Inside, the head returns the summed loss of `targets` (each position's own target: labels
        shifted already) as its output, `tokens` at a time."""
        self.now.batch = (targets, tokens)
        try:
            yield
        finally:
            self.now.batch = None

    def _call(self, hidden: torch.Tensor) -> torch.Tensor:
        targets, tokens = getattr(self.now, "batch", None) or (None, 0)
        if targets is None:
            return self.forward(hidden)
        width = max(1, tokens // hidden.size(0))  # sequence positions a chunk takes of every row
        pieces = zip(hidden.split(width, dim=1), targets.split(width, dim=1))
        # (1, 1, 1): where a model slices its logits' last dimension (a padded vocabulary), it still can
        return sum(checkpoint(self._chunk_loss, h, t, use_reentrant=False) for h, t in pieces).reshape(1, 1, 1)

    def _chunk_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss(self.forward(hidden), targets, seq2seq=False, shifted=True)

    def remove(self) -> None:
        if self.shadowed:
            self.head.forward = self.forward
        else:
            del self.head.forward


def chunked_head(model: torch.nn.Module, setting: int | None) -> ChunkedHead | None:
    """The chunked head of a decoder-only model, or None where its logits are not the head's output
    alone (an encoder-decoder; a final soft-capping of the logits, Gemma's) or `setting` is 0."""
    config, head = model.config, model.get_output_embeddings()
    if setting == 0 or head is None or config.is_encoder_decoder or getattr(config, "final_logit_softcapping", None):
        return None
    return ChunkedHead(head, setting, config.vocab_size)

"""GPipe-style micro-batching inside one process (`chunks=N`), so that the devices of a split model
work at the same time, with no change to the model and no extra processes.

Forward: schedule.py runs the micro-batches' calls on the GPipe clock (stage s on micro-batch t - s
at tick t), issuing each GPU's kernels on its own stream before the host blocks on anything, with
copies between stages that wait on events (streams.py), not on whole devices.

Backward: one autograd call over the (weighted) sum of the micro-batches' losses, not one call per
micro-batch. Autograd runs each GPU's nodes on a thread of its own (which only queues kernels, with
the GIL released) and CPU nodes on the calling thread, so a single call lets every device work at
once. One call per micro-batch, even in reverse order, cannot: each call returns only when its last
node ran, and a GPU's stream would hold micro-batch m's first-stage backward before micro-batch
m - 1's last-stage one, so each stage would wait for the others' previous micro-batch. Within the
one call, schedule.py's order edges make each stage take the micro-batches one at a time, last
first, and hand each on as soon as it is done.

Losses and gradients equal the unchunked ones; dropout draws differ (a different call order), as
in any pipeline. Under autocast, `train_step` casts each weight once per step (casts.py), not once
per micro-batch; each micro-batch's weight gradient is still cast to fp32 and added into `.grad`:
chunks pay off on compute-bound stages (docs/device_map.md).
"""
from __future__ import annotations

import contextlib

import torch

from ..errors import BigfitError
from .casts import autocasting, cast_once
from .hooks import layout_of
from .schedule import idle, reached, run_chunks

__all__ = ["idle", "reached", "run_chunks", "split_batch", "train_step"]


def split_batch(batch: dict, chunks: int) -> list[dict]:
    """Split every tensor along dim 0 into `chunks` micro-batches (sizes differ by at most one)."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor)}
    if len(sizes) != 1:
        raise BigfitError(f"chunks: the batch's tensors disagree on the batch size ({sorted(sizes)})")
    n = sizes.pop()
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= n:
        raise BigfitError(f"chunks must be an integer from 1 to the batch size {n}, got {chunks!r}")
    parts = {k: torch.tensor_split(v, chunks) if isinstance(v, torch.Tensor) else [v] * chunks
             for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(chunks)]


@contextlib.contextmanager
def _autocast_off():
    """For a backward called inside the caller's autocast region: autocast is for the forward
    (PyTorch's advice). Left on, backward formulas go through it too: on the tiny T5, 40 more casts
    and gradients 1e-2 of their largest entry away from a backward outside autocast."""
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield


def _target_tokens(model, part: dict) -> int:
    """Tokens a Hugging Face loss averages over: labels other than -100 (shifted by one for causal LMs)."""
    labels = part["labels"]
    seq2seq = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return int(((labels if seq2seq else labels[:, 1:]) != -100).sum())


def train_step(model: torch.nn.Module, batch: dict, chunks: int = 1) -> torch.Tensor:
    """Forward and backward of `batch` (with `labels`) through a parallelized model, as `chunks`
    micro-batches run in GPipe order. The model's own loss is a token mean per call, so each
    chunk's loss is weighted by its share of the batch's target tokens: loss and gradients are
    those of one unchunked call. Autocast, if on, covers the forward only. Returns the (detached)
    loss; the optimizer step is the caller's."""
    layout = layout_of(model)
    if layout is None:
        raise BigfitError("train_step needs a parallelized model; call parallelize(model, device_map) first")
    parts = split_batch(batch, chunks)
    counts = [_target_tokens(model, p) for p in split_batch({"labels": batch["labels"].cpu()}, chunks)]
    total = sum(counts)
    if total == 0:
        raise BigfitError("train_step: the batch has no target tokens (every label is -100)")
    with cast_once(model, enabled=chunks > 1 and autocasting()):  # one micro-batch: autocast's cache serves it
        losses = run_chunks(lambda part: model(**part).loss, parts, layout.main, ordered_backward=True)
    loss = sum(l * (n / total) for l, n in zip(losses, counts) if n)  # a chunk with no targets adds nothing
    with _autocast_off():
        loss.backward()
    return loss.detach()

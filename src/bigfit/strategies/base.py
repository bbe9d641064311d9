"""What applying a strategy returns: the callable model plus the few hooks the loop needs."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch


@contextlib.contextmanager
def syncing(owner, sync: bool):
    """`owner.sync` is `sync` inside (False for accumulation micro-batches, whose gradients wait for
    the last one), True again after, also after an error."""
    owner.sync = sync
    try:
        yield
    finally:
        owner.sync = True


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class Applied:
    model: torch.nn.Module  # what the training loop calls (a DDP wrapper, an FSDP2 module, or the model)
    module: torch.nn.Module  # the Hugging Face model itself: config, generate(), state dict names
    strategy: str
    autocast: torch.dtype | None = None  # autocast dtype for forward passes (mixed precision without FSDP)
    notes: list[str] = field(default_factory=list)  # what was applied, for the start-of-run table
    generates: bool = True  # evaluation may call generate() (not across pipeline stages)

    def data_runtime(self, rt):
        """The ranks the global batch is divided over: every rank, except where ranks are pipeline
        stages that all see the whole batch."""
        return rt

    def forward_context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        device = next(self.module.parameters()).device.type
        return torch.autocast(device, dtype=self.autocast)

    def accumulation_context(self, sync: bool):
        """Skip the gradient all-reduce on accumulation micro-batches (DDP); a no-op elsewhere."""
        if sync or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def generation_context(self):
        """generate() calls the encoder and the embeddings directly, not through the root forward, so
        parameters that FSDP2 keeps in the root group must be gathered for the whole call."""
        return contextlib.nullcontext()

    def reshard(self) -> None:
        """Return parameters to their at-rest layout after forward passes without backward."""

    def finish_backward(self) -> None:
        """Combine gradients that the engine left apart (tied copies on pipeline stages); a no-op here."""

    def clip_grad_norm(self, params: list, max_norm: float) -> float:
        """The global gradient norm (clipped to `max_norm` when it is positive)."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    def make_optimizer(self, cls, **kw) -> torch.optim.Optimizer:
        return cls(self.model.parameters(), **kw)

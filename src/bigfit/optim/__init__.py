"""Optimizers for the user's own loop: `OffloadAdamW`, the offload engine's host step (master weights and
Adam's moments in host RAM or files, bigfit's host kernel) as a drop-in torch.optim.Optimizer."""
from .offload_adamw import OffloadAdamW

__all__ = ["OffloadAdamW"]

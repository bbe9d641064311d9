"""Mixed precision: dtypes, and fp16 loss scaling with DeepSpeed's semantics.

bf16 and fp16 both keep fp32 master weights (the optimizer updates fp32 parameters; only compute runs
in the low-precision dtype) and reduce gradients in fp32 unless `reduce_dtype` says otherwise.

fp16 gradients overflow where bf16's would not, so the loss is multiplied by a scale before backward
and the gradients divided by it before the step. Dynamic scaling (DeepSpeed's DynamicLossScaler):
start at 2**initial_scale_power; on an overflow skip the step and, once `hysteresis` overflows have
been tolerated, halve the scale (never below min_loss_scale); after `loss_scale_window` steps without
an overflow, double it. A static scale (loss_scale > 0) never changes; overflowed steps are still
skipped. Overflow is decided over all ranks together, so every rank skips the same steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Families pretrained in bf16 whose activations exceed fp16's range (T5's feed-forward outputs).
FP16_UNSAFE = ("t5", "mt5", "umt5", "longt5", "switch_transformers")
MIN_SCALE_ALARM = 3  # consecutive overflows at the minimum scale before the loop says so


def compute_dtype(precision: str) -> torch.dtype | None:
    """The low-precision compute dtype, or None for fp32."""
    return None if precision == "fp32" else DTYPES[precision]


def fp16_warning(model_type: str, precision: str) -> str | None:
    if precision == "fp16" and model_type in FP16_UNSAFE:
        return (f"warning: {model_type} models are usually pretrained in bf16 and overflow in fp16 (the loss "
                "scale then collapses to its minimum and steps are skipped); prefer --precision bf16 (or fp32)")
    return None


@dataclass
class LossScaler:
    """fp16 loss scale. `scale` multiplies the loss; `update(overflow)` after every step."""

    scale: float = 2.0 ** 16
    dynamic: bool = True
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    overflows: int = 0  # steps skipped so far
    streak_at_min: int = 0  # consecutive overflowed steps at the minimum scale
    _tolerance: int = 0  # overflows still tolerated before halving (DeepSpeed's cur_hysteresis)
    _good_steps: int = 0  # steps since the last overflow or scale change

    @classmethod
    def from_config(cls, cfg) -> "LossScaler":
        if cfg.loss_scale > 0:
            return cls(scale=float(cfg.loss_scale), dynamic=False)
        return cls(scale=2.0 ** cfg.initial_scale_power, window=cfg.loss_scale_window, hysteresis=cfg.hysteresis,
                   min_scale=float(cfg.min_loss_scale), _tolerance=cfg.hysteresis)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.overflows += 1
            self.streak_at_min = self.streak_at_min + 1 if self.scale <= self.min_scale else 0
            self._good_steps = 0
            if self.dynamic:
                if self._tolerance <= 1:
                    self.scale = max(self.scale / 2, self.min_scale)
                else:
                    self._tolerance -= 1
            return
        self.streak_at_min = 0
        self._good_steps += 1
        if self.dynamic and self._good_steps % self.window == 0:
            self.scale *= 2
            self._tolerance = self.hysteresis

    @property
    def alarm(self) -> bool:
        """True once steps keep overflowing with the scale already at its minimum."""
        return self.streak_at_min >= MIN_SCALE_ALARM

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)

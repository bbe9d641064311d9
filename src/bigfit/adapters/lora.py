"""LoRA adapters through peft, injected in place into the unmodified model.

`peft.inject_adapter_in_model` replaces each targeted linear layer (nn.Linear, GPT-2's Conv1D) by a
peft layer holding the original as `base_layer` beside two small matrices `lora_A` and `lora_B`, and
freezes everything else. The model keeps its class and its module paths (no PeftModel wrapper), so
block discovery, the seeded init, the safetensors reader and every strategy's transform see the same
model they always do, with frozen base weights and a few trainable tensors in each block. The
names differ from the base model's only by `.base_layer` (base weights) and `.lora_A.default` /
`.lora_B.default` (adapters): `base_name` maps the first back to the checkpoint's keys.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import BigfitError

if TYPE_CHECKING:  # the command's checks read LoraSettings before anything needs torch (data/__init__.py)
    import torch

ADAPTER = "default"  # peft's adapter name: the one adapter bigfit trains
ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output head


@dataclass(frozen=True)
class LoraSettings:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: str = ALL_LINEAR  # "all-linear" or comma-separated module names (q_proj,v_proj)

    @classmethod
    def from_config(cls, cfg) -> "LoraSettings | None":
        """The run's LoRA settings, or None for full fine-tuning."""
        if not getattr(cfg, "lora", False):
            return None
        return cls(cfg.lora_r, float(cfg.lora_alpha), cfg.lora_dropout, cfg.lora_targets)

    @classmethod
    def checked(cls, lora: bool, given: dict, verb: str) -> "LoraSettings | None":
        """A command's LoRA settings from the `--lora-*` values it was given (field name -> value; the
        rest default), or None without --lora: one line for values given without --lora (`verb`:
        what --lora would do with them) or out of range. `bigfit train` and `bigfit plan` both ask."""
        if not lora:
            if given:
                flags = ", ".join("--" + f.replace("_", "-") for f in given)
                raise BigfitError(f"{flags} set without --lora: add --lora to {verb} adapters, or drop them")
            return None
        s = cls(**{f.removeprefix("lora_"): v for f, v in given.items()})
        if s.r < 1 or s.alpha <= 0 or not 0 <= s.dropout < 1 or not s.targets.strip():
            raise BigfitError(f"--lora needs --lora-r >= 1, --lora-alpha > 0, 0 <= --lora-dropout < 1 and some "
                              f"--lora-targets; got {s.r}, {s.alpha:g}, {s.dropout:g}, {s.targets!r}")
        return s

    def target_modules(self) -> str | list[str]:
        if self.targets.strip() == ALL_LINEAR:
            return ALL_LINEAR
        return [t.strip() for t in self.targets.split(",") if t.strip()]


def _peft():
    try:
        import peft
    except ImportError:
        raise BigfitError("--lora needs the peft library: pip install 'bigfit[lora]'") from None
    return peft


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what --lora-targets may name)."""
    return sorted({path.rpartition(".")[2] for path, m in model.named_modules() if _linear(m)})


def _linear(module: torch.nn.Module) -> bool:
    """nn.Linear (its subclasses too: bitsandbytes' 4-bit layers) or GPT-2's Conv1D."""
    from torch import nn  # loaded already: `module` is one of its modules

    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def check_targets(model: torch.nn.Module, settings: LoraSettings) -> None:
    """One line when a named target matches no linear layer of the model, naming those it has."""
    targets = settings.target_modules()
    if targets == ALL_LINEAR:
        return
    have = linear_names(model)
    missing = [t for t in targets if not any(re.fullmatch(t, n) for n in have)]
    if missing or not targets:
        raise BigfitError(f"--lora-targets {settings.targets!r}: {', '.join(missing) or 'nothing'} matches no linear "
                          f"layer of this model; its linear layers are {', '.join(have)} (or give {ALL_LINEAR})")


def peft_config(settings: LoraSettings, model: torch.nn.Module):
    check_targets(model, settings)
    return _peft().LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                              target_modules=settings.target_modules(), bias="none")


def inject(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Adapters into `model` in place (on whatever device its tensors are, the meta device too); the
    base frozen. Returns the same model object."""
    import warnings

    with warnings.catch_warnings():  # GPT-2's Conv1D: peft sets fan_in_fan_out itself and says so
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
        _peft().inject_adapter_in_model(peft_config(settings, model), model, adapter_name=ADAPTER)
    return model


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A tensor's name in the base model (its checkpoint's key): the peft layer's `.base_layer` dropped."""
    return name.replace(".base_layer.", ".")


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A peft LoRA layer (the parent of a lora_A / lora_B pair). Without peft imported there is none:
    the seeded init asks this of every module, and importing peft costs a process seconds."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.tuners.lora.LoraLayer)


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())


def adapter_parameters(model: torch.nn.Module, settings: LoraSettings) -> int:
    """The parameters `inject` would add, r x (in + out) a targeted layer, counted without peft (the
    disk check runs before any process starts; importing peft takes seconds): its rules, every
    linear layer but the output head, or those whose path is or ends in a target's name."""
    targets, head = settings.target_modules(), model.get_output_embeddings()
    n = 0
    for path, m in model.named_modules():
        if not _linear(m):
            continue
        if (m is not head) if targets == ALL_LINEAR else any(path == t or path.endswith("." + t) for t in targets):
            n += settings.r * sum(m.weight.shape)  # Linear's (out, in), Conv1D's (in, out)
    return n

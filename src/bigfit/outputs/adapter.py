"""The LoRA part of `bigfit consolidate`: a `--lora` checkpoint -> a peft adapter, or a merged model.

A LoRA run's model is the one adapters/lora.py injected: each targeted layer's base weight under
`<path>.base_layer.weight` (frozen, the base model's values) beside `<path>.lora_A.default.weight`
(r x in) and `<path>.lora_B.default.weight` (out x r). Its checkpoints hold the trainable tensors
(the adapters) alone; checkpoints of earlier versions hold the base too. Two ways out:
- an adapter directory, what `PeftModel.save_pretrained` writes: adapter_config.json and
  adapter_model.safetensors keyed `base_model.model.<path>.lora_A.weight` (peft drops the adapter
  name on save and puts it back on load). Only the adapters are read: megabytes, not the model.
- a merged model: each targeted weight becomes W + (B @ A) * alpha / r (transposed for GPT-2's
  Conv1D, which stores W as in x out), under the base model's names, so transformers alone loads it.
  W and the base's other tensors come from the checkpoint where it holds them, else from the base
  made again from the run's source (basesource.py): `names` are then both.
Which layers got adapters is read from the checkpoint's keys, not recomputed from --lora-targets:
the keys are what was trained.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..adapters.lora import ADAPTER, base_name
from ..errors import BigfitError

A, B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"
BASE = ".base_layer.weight"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF model, in peft's saved keys

Reader = Callable[[list[str]], dict[str, torch.Tensor]]  # checkpoint names -> their tensors


@dataclass
class LoraCheckpoint:
    """The adapters of one `--lora` checkpoint, against a weightless (meta) copy of its base model."""

    settings: dict  # the run's TrainConfig dict (trainer.json "config")
    names: set[str]  # the run's model tensor names (no "model." prefix): the checkpoint's, and a rebuilt base's
    base: torch.nn.Module  # the base model on the meta device: module paths and types

    def __post_init__(self):
        self.paths = sorted(n[: -len(A)] for n in self.names if n.endswith(A))
        # the base weight is needed to merge only: a checkpoint holds the adapters alone
        if missing := [p for p in self.paths if p + B not in self.names]:
            raise BigfitError(f"LoRA checkpoint: layer {missing[0]!r} lacks its lora_B; the checkpoint is not "
                              "one bigfit wrote")
        modules = dict(self.base.named_modules())
        self.conv1d = {p for p in self.paths if type(modules.get(p)).__name__ == "Conv1D"}  # W is in x out
        self.scale = float(self.settings["lora_alpha"]) / int(self.settings["lora_r"])

    # the adapter directory

    def adapter_tensors(self, read: Reader) -> dict[str, torch.Tensor]:
        """The adapters under peft's saved names; nothing else is read."""
        got = read([p + s for p in self.paths for s in (A, B)])
        return {PEFT_PREFIX + p + s.replace(f".{ADAPTER}.", "."): got[p + s] for p in self.paths for s in (A, B)}

    def peft_config(self):
        """peft's LoraConfig for the trained adapters, as PeftModel.save_pretrained would write it."""
        try:
            from peft import LoraConfig
        except ImportError:
            raise BigfitError("a LoRA checkpoint's adapter directory needs the peft library: pip install "
                              "'bigfit[lora]' (or consolidate with --merge, which needs only torch)") from None
        seq2seq = getattr(self.base.config, "is_encoder_decoder", False)
        return LoraConfig(r=int(self.settings["lora_r"]), lora_alpha=self.settings["lora_alpha"],
                          lora_dropout=self.settings["lora_dropout"], target_modules=self.target_modules(),
                          fan_in_fan_out=bool(self.conv1d), bias="none", inference_mode=True,
                          task_type="SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM",
                          base_model_name_or_path=self.settings.get("model"))

    def target_modules(self) -> list[str]:
        """The layers' last names (q_proj, v_proj) when those pick out exactly the adapted layers in
        the base model (peft matches a name as a path suffix), else their full paths."""
        last = {p.rpartition(".")[2] for p in self.paths}
        matched = {p for p, _ in self.base.named_modules() if p and p.rpartition(".")[2] in last}
        return sorted(last) if matched == set(self.paths) else self.paths

    # the merged model

    def sources(self) -> dict[str, list[str]]:
        """Each base-model tensor name -> the checkpoint names that make it: its own first, then a
        targeted weight's lora_A and lora_B."""
        if missing := [p for p in self.paths if p + BASE not in self.names]:
            raise BigfitError(f"LoRA checkpoint: layer {missing[0]!r} has no base weight to merge the adapter into")
        out = {}
        for n in sorted(self.names):
            if n.endswith((A, B)):
                continue
            path = n[: -len(BASE)] if n.endswith(BASE) else None
            out[base_name(n)] = [n] + ([path + A, path + B] if path in self.paths else [])
        return out

    def targeted(self) -> set[str]:
        """Base-model names of the weights that merging changes."""
        return {p + ".weight" for p in self.paths}

    def merged(self, name: str, srcs: list[str], got: dict[str, torch.Tensor]) -> torch.Tensor:
        """Tensor `name` of the merged model from its sources' values (`got`), in the base's dtype."""
        w = got[srcs[0]]
        if len(srcs) == 1:
            return w
        delta = (got[srcs[2]].float() @ got[srcs[1]].float()) * self.scale  # B @ A: out x in
        if name[: -len(".weight")] in self.conv1d:
            delta = delta.T
        return (w.float() + delta).to(w.dtype).contiguous()

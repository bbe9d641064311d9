"""The pieces hf.py puts into a Trainer: its optimizer over the engine (`EngineOptimizer`), the
engine's checkpoint beside Trainer's (`EngineCheckpoints`), the resume path noted for it
(`resumed_train`) and a saved model that is a normal Hugging Face directory (`saved_model`)."""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from ..adapters.lora import ADAPTER, LoraSettings, is_adapter, peft_config
from ..errors import BigfitError
from ..outputs.adapter import PEFT_PREFIX
from .engine import UserEngine

ENGINE_FOLDER = "bigfit"  # the engine's checkpoint inside Trainer's checkpoint-N directory


def checkpoint_dir(args, step: int) -> str:
    """Where Trainer writes the checkpoint of `step` (its run directory is output_dir unless a
    hyperparameter search names another)."""
    return os.path.join(args.output_dir, f"checkpoint-{step}")


class EngineOptimizer(torch.optim.Optimizer):
    """Trainer's optimizer, the engine underneath. Its one param group IS the engine's (UserEngine.
    param_group), so Trainer's lr scheduler sets the lr the engine steps with; step() is the engine's
    update (unscale, clip to max_grad_norm, step, zero the gradients); zero_grad() has nothing left to
    do. Its state_dict is a marker: the optimizer's states are in the engine's checkpoint (DCP, every
    rank's shard), which load_state_dict reads from the checkpoint being resumed (`resume_from`)."""

    def __init__(self, engine: UserEngine):
        group = engine.param_group
        group["params"] = [p for p in engine.module.parameters() if p.requires_grad]
        super().__init__([group], {"lr": group["lr"]})
        self.engine = engine
        self.norm = torch.zeros(())  # the gradient norm Trainer logs: it asks before the step, this fills it
        self.resume_from: str | None = None
        self._is_accelerate_prepared = True  # accelerate's prepare keeps it as it is (no AcceleratedOptimizer)

    def step(self, closure=None):
        if closure is not None:
            raise BigfitError("bigfit.hf: the engine's optimizer takes no closure (Trainer passes none)")
        self.engine.update()
        self.norm.fill_(self.engine.grad_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine's update zeroed the gradients (or keeps none in the parameters: offload)."""

    @property
    def step_was_skipped(self) -> bool:
        """fp16: the step was skipped for overflowed gradients (accelerate then holds the lr schedule)."""
        return self.engine.scaler is not None and not math.isfinite(self.engine.grad_norm or 0.0)

    def state_dict(self) -> dict:
        """The engine's step and the group's settings (its lr: the scheduler Trainer restores does not set it)."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params" and isinstance(v, (int, float, str))}
        return {"bigfit_step": self.engine.global_step, "group": group}

    def load_state_dict(self, state_dict: dict) -> None:
        if "bigfit_step" not in state_dict:
            raise BigfitError("bigfit.hf: the checkpoint's optimizer.pt is a torch optimizer's, not bigfit's: resume "
                              "from a checkpoint saved by a Trainer that bigfit.hf.use trained")
        folder = Path(self.resume_from or "") / ENGINE_FOLDER
        if self.resume_from is None or not folder.is_dir():
            raise BigfitError(f"bigfit.hf: {folder} is missing; resume with trainer.train(resume_from_checkpoint=...) "
                              "from a checkpoint saved while bigfit.hf.use trained")
        self.engine.load(folder)
        self.param_groups[0].update(state_dict.get("group", {}))
        if self.engine.global_step != state_dict["bigfit_step"]:
            raise BigfitError(f"bigfit.hf: {folder} holds step {self.engine.global_step}, optimizer.pt step "
                              f"{state_dict['bigfit_step']}; the checkpoint directory is mixed up")


class EngineCheckpoints(TrainerCallback):
    """The engine's checkpoint (DCP: model and optimizer, each rank its part) in checkpoint-N/bigfit,
    saved by every rank when Trainer saves; the engine's pending update landed before Trainer reads
    the weights (evaluation, saving) and at the end."""

    def __init__(self, engine: UserEngine):
        self.engine = engine

    def on_step_end(self, args, state, control, **kw):
        if control.should_evaluate or control.should_save:
            self.engine.flush()

    on_epoch_end = on_step_end

    def on_save(self, args, state, control, **kw):
        self.engine.save(os.path.join(checkpoint_dir(args, state.global_step), ENGINE_FOLDER))

    def on_train_end(self, args, state, control, **kw):
        self.engine.flush()


def resumed_train(trainer, optimizer: EngineOptimizer):
    """trainer.train, noting the checkpoint it resumes from (True: the newest in output_dir, as
    Trainer finds it) for the optimizer's load."""
    original = trainer.train

    def train(resume_from_checkpoint=None, *args, **kwargs):
        path = resume_from_checkpoint
        if isinstance(path, bool):
            path = get_last_checkpoint(trainer.args.output_dir) if path else None
        optimizer.resume_from = path
        return original(resume_from_checkpoint, *args, **kwargs)

    return train


def saved_model(trainer, engine: UserEngine):
    """trainer.save_model writing a Hugging Face directory: Trainer's own save where the module holds
    whole tensors; the full state dict gathered (every rank) and saved by the main process where FSDP2
    shards it; the adapters alone, as peft saves them, for bigfit's LoRA (lora=True)."""
    original = trainer.save_model

    def save_model(output_dir: str | None = None, _internal_call: bool = False):
        engine.flush()
        lora = LoraSettings.from_config(engine.cfg)
        if not lora and not _sharded(engine.module):
            return original(output_dir, _internal_call)
        output_dir = output_dir or trainer.args.output_dir
        state = _full_state(engine.module)
        if trainer.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            if lora:
                _save_adapter(engine.module, lora, state, output_dir)
            else:
                trainer.model.save_pretrained(output_dir, state_dict=state)  # a PeftModel saves its adapters
            if hasattr(trainer.processing_class, "save_pretrained"):
                trainer.processing_class.save_pretrained(output_dir)
            torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))

    return save_model


def _sharded(module: torch.nn.Module) -> bool:
    return any(isinstance(p, torch.distributed.tensor.DTensor) for p in module.parameters())


def _full_state(module: torch.nn.Module) -> dict:
    """Every tensor whole, in host memory (collective under FSDP2: every rank calls it)."""
    if not _sharded(module):
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _save_adapter(module, lora: LoraSettings, state: dict, output_dir: str) -> None:
    """What PeftModel.save_pretrained writes: adapter_config.json and adapter_model.safetensors keyed
    base_model.model.<path>.lora_A.weight (peft drops the adapter's name on save)."""
    from safetensors.torch import save_file

    config = peft_config(lora, module)
    config.base_model_name_or_path = getattr(module.config, "_name_or_path", None) or None
    config.save_pretrained(output_dir)
    adapters = {PEFT_PREFIX + k.replace(f".{ADAPTER}.", "."): v.contiguous() for k, v in state.items() if is_adapter(k)}
    save_file(adapters, os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})

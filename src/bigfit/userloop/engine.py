"""`UserEngine`: what `bigfit.prepare` returns. The user owns the loss; the engine (engine/protocol.py's,
the one `bigfit train`'s loop drives) owns forward's precision, backward, the step and checkpoints.

    engine = bigfit.prepare(model, strategy="zero2", precision="bf16", lr=1e-4)
    for batch in engine.loader(dataset, batch_size=8, collate_fn=collate):
        loss = my_loss(engine.model(**batch), batch)
        engine.backward(loss)
        engine.step()
    engine.save("checkpoints")            # bigfit consolidate turns it into a Hugging Face directory

Gradient accumulation is DeepSpeed's: call backward and step every micro-batch; backward divides the
loss by the accumulation steps and step updates on every `gradient_accumulation_steps`-th call. The
micro-batches before it skip the gradient reduction where the engine can (DDP's no_sync, the offload
engine's buckets): each micro-step opens the engine's accumulation context at its forward and
closes it after its backward (`_MicroStep`). Data-parallel engines average gradients over their
ranks, so a loss that is each rank's mean gives the global mean's gradients.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from ..common.distributed import Runtime, shutdown
from ..common.precision import LossScaler
from ..engine import Engine
from ..errors import BigfitError
from ..job.resolution import Job
from ..layout.mesh import release_run_groups
from ..training import checkpoint
from ..training.step import lr_at
from .data import loader, shard, split
from .wrapped import Forward


class UserEngine:
    """The prepared model and its engine (`engine`: the loop's Engine). `model` is what to call: the
    model, or its DDP / FSDP2 wrapper, whose forward runs under the engine's precision. `module` is the
    Hugging Face model itself (config, generate, save_pretrained names)."""

    def __init__(self, engine: Engine, job: Job, rt: Runtime, scaler: LossScaler | None = None, tokenizer=None,
                 scheduled: bool = False, sets_lr: bool = True):
        self.engine, self.job, self.rt, self.scaler, self.tokenizer = engine, job, rt, scaler, tokenizer
        self.cfg = job.cfg
        self.model, self.module = engine.model, engine.module
        self.gradient_accumulation_steps = job.batching.grad_accum
        self.global_step = 0  # optimizer steps taken (skipped fp16 overflows included, as DeepSpeed counts)
        self.grad_norm: float | None = None  # the last step's global gradient norm (before clipping)
        self._micro = 0  # backward passes since the last update
        self._stepped = True  # step() was called since the last backward
        # bigfit's lr schedule (training/step.py lr_at) where the settings gave one (max_steps, warmup_steps,
        # lr_schedule): a loop's length is the user's; else the lr stays as set (engine.lr = ..., a scheduler)
        self._scheduled = scheduled
        self._sets_lr = sets_lr  # False: the user's own optimizer (prepare's optimizer=) keeps its lr and scheduler
        # the lr and weight decay of the next step, as an optimizer's param group: a facade optimizer
        # (hf.py) shares this dict, so a torch lr scheduler that edits its group sets the engine's lr
        self.param_group = {"lr": lr_at(0, self.cfg) if scheduled else self.cfg.lr}
        # whether the micro-step under way ends the accumulation (its gradients are reduced): by the
        # engine's own count, or by the caller's (Trainer knows when an epoch ends early: hf.py)
        self.syncs: Callable[[], bool] = lambda: self._micro + 1 >= self.gradient_accumulation_steps
        self._forward = Forward(self.model, engine, lambda: self.syncs())

    # -- what was applied ----------------------------------------------------------------------
    @property
    def plan(self) -> dict:
        """The plan applied (strategy and degrees), what each transform did, the batch split and the
        planner's prediction for it on this machine."""
        return {"strategy": self.job.plan.name, "plan": self.job.plan.describe(), "degrees": self.job.plan.to_dict(),
                "applied": list(self.engine.notes), "precision": self.cfg.precision,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "data_parallel_ranks": self.rt.data.world_size,
                "prediction": self.job.prediction}  # rated on the job's rank 0 only (None elsewhere)

    @property
    def is_main(self) -> bool:
        return self.rt.is_main

    @property
    def device(self) -> torch.device:
        return self.rt.device

    # -- data ----------------------------------------------------------------------------------
    def loader(self, dataset, batch_size: int, **kw):
        """A DataLoader over this data-parallel rank's part of `dataset` (tensor- and pipeline-parallel
        peers read the same part), reshuffled each pass (data.py)."""
        return loader(dataset, batch_size, self.rt.data, seed=self.cfg.seed, **kw)

    def shard(self, dataloader):
        """The user's DataLoader over this rank's part of its dataset, its other settings kept."""
        return shard(dataloader, self.rt.data, seed=self.cfg.seed)

    def split(self, batch: dict) -> dict:
        """This data-parallel rank's rows of a global batch (a dict of tensors), moved to the device."""
        return split(batch, self.rt.data, self.rt.device)

    # -- the step ------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, scale_by_accumulation: bool = True) -> None:
        """Backpropagate `loss` (a scalar the user computed from engine.model's outputs), divided by the
        accumulation steps unless told not to, times the fp16 loss scale."""
        if not (torch.is_tensor(loss) and loss.numel() == 1 and loss.requires_grad):
            raise BigfitError("engine.backward(loss): loss must be a one-element tensor that requires grad (computed "
                              f"from engine.model's outputs), got {_what(loss)}")
        if self._micro == 0 and self._sets_lr:
            self.engine.set_lr(self.lr)  # before backward: an engine may step during it (the offload engine)
        factor = (self.scaler.scale if self.scaler else 1.0) / (
            self.gradient_accumulation_steps if scale_by_accumulation else 1)
        with self._forward.backward():
            (loss * factor).backward()
        self._micro, self._stepped = self._micro + 1, False

    def forward_backward(self, batch: dict) -> torch.Tensor:
        """Forward and backward of one micro-batch (a dict of tensors with labels) with prepare's
        `loss_fn(logits, labels)`: the way in for pipeline stages, whose schedule runs the loss itself
        (any strategy takes it). Returns the loss, detached: on a pipeline, the last stage's rank holds
        it and the others 0."""
        if self.engine.loss_fn is None:
            raise BigfitError("engine.forward_backward(batch) computes the loss with bigfit.prepare(loss_fn=...): "
                              "pass loss_fn=(logits, labels) -> loss to prepare")
        if self._micro == 0 and self._sets_lr:
            self.engine.set_lr(self.lr)
        factor = (self.scaler.scale if self.scaler else 1.0) / self.gradient_accumulation_steps
        batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        if "attention_mask" not in batch:  # every position attended (the engines' forward passes it on)
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        loss = self.engine.run_batch(batch, self.module.config.is_encoder_decoder, factor, sync=self.syncs())
        self._micro, self._stepped = self._micro + 1, False
        return loss

    def step(self) -> None:
        """After each backward: on every gradient_accumulation_steps-th, unscale, clip to max_grad_norm,
        step (skipped when fp16 gradients overflowed), zero the gradients and move the lr schedule."""
        if self._stepped:
            raise BigfitError("engine.step() before engine.backward(loss): each micro-batch is forward, "
                              "engine.backward(loss), then engine.step()")
        self._stepped = True
        if self._micro >= self.gradient_accumulation_steps:
            self.update()

    def update(self) -> None:
        """The optimizer step now, whatever the accumulation count (step() calls it at the count; a
        caller that counts itself, Trainer's facade optimizer, calls it directly)."""
        self.grad_norm = self.engine.update(self.cfg.max_grad_norm, self.scaler.scale if self.scaler else 1.0)
        if self.scaler:
            self.scaler.update(not math.isfinite(self.grad_norm))
        self._micro, self.global_step = 0, self.global_step + 1
        if self._scheduled:
            self.lr = lr_at(self.global_step, self.cfg)

    @property
    def lr(self) -> float:
        return self.param_group["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.param_group["lr"] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: step() leaves the gradients zeroed (kept for loops that call it)."""

    def flush(self) -> None:
        """Land an update still under way (the offload engine's delayed update) before reading weights."""
        self.engine.flush()

    def generate(self, *args, **kwargs):
        """module.generate under the engine's precision and what it needs (gathered FSDP2 roots)."""
        self.flush()
        with self.engine.generation_context(), self.engine.forward_context(), torch.no_grad():
            out = self.module.generate(*args, **kwargs)
        self.engine.reshard()
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, directory) -> Path:
        """Collective: a verified, atomic checkpoint in `directory`/step-NNNNNNNN (DCP, keyed by parameter
        names: it loads at another process count and strategy; `bigfit consolidate` makes a Hugging Face
        directory of it). Returns its path."""
        self.flush()
        trainer = {"step": self.global_step, "world_size": self.rt.world_size, "config": self.cfg.to_dict(),
                   "plan": self.job.plan.to_dict(), "loss_scaler": self.scaler.state_dict() if self.scaler else None,
                   "run_id": None, "identity": None, "micro_steps": self._micro}
        return checkpoint.save(Path(directory), self.global_step, self.engine, self.rt, trainer,
                               checkpoint.assets_writer(self.module, self.tokenizer))

    def load(self, path) -> dict:
        """Restore a checkpoint `save` (or bigfit train) wrote: a step directory, or the newest complete
        one in `path`. Returns its trainer.json (its "step" is engine.global_step now)."""
        found = checkpoint.newest(Path(path))
        trainer = checkpoint.load(found, self.engine, self.rt)
        self.global_step, self._micro, self._stepped = int(trainer["step"]), 0, True
        if self.scaler and trainer.get("loss_scaler"):
            self.scaler.load_state_dict(trainer["loss_scaler"])
        if self._scheduled:
            self.lr = lr_at(self.global_step, self.cfg)
        return trainer

    def close(self) -> None:
        """Undo what prepare set up in this process: the forward wrapper, the plan's process groups, and
        the default group where prepare made it. A notebook prepares again after it."""
        self.flush()
        self._forward.remove()
        release_run_groups()
        shutdown(self.rt)

    def __enter__(self) -> "UserEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _what(x) -> str:
    if torch.is_tensor(x):
        return f"a tensor of shape {tuple(x.shape)}" + ("" if x.requires_grad else " that requires no grad")
    return type(x).__name__

"""The engine the training loop drives for zero2-offload(-nvme): the model (or this rank's pipeline
stages) with the offload engine's hooks (engine.py). The offload engine, not a torch optimizer,
holds the states and steps them.

Over pipeline stages each stage's optimizer lives in host RAM, its rows sharded over the stage's
data-parallel ranks: torch's schedule runs the micro-batch's chunks with the engine accumulating
(its hooks add each chunk's gradients to the bucket buffers), then tied copies are summed over
their stages and every bucket goes down at once (`land`). Tied copies' gradients wait on the
parameters for that sum (`held`), and only one copy counts in the norm.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..engine.protocol import Applied, Loading
from .engine import OffloadEngine


@dataclass
class OffloadApplied(Applied):
    """zero2-offload(-nvme): the model itself, in the compute dtype, with the engine's hooks. The
    engine, not a torch optimizer, holds the states and steps them."""
    engine: OffloadEngine | None = None
    stages: Applied | None = None  # pipeline stages that run each micro-batch; None: the model whole
    updates_in_background: bool = True  # the host step and its copies up run on under the next forward

    def __post_init__(self):
        # a failed step is abandoned in place (`abandon_step`: its host step ended or stopped, its
        # buckets freed) in every mode, unless pipeline stages hold its gradients (their schedule's
        # state): those restart the probe's processes
        self.recovers_from_oom = self.engine is not None and self.stages is None

    def recover_from_oom(self) -> None:
        self.engine.abandon_step()  # the states exist from `attach` on, whole: nothing half made

    def accumulation_context(self, sync: bool):
        return self.engine.syncing(sync)

    def run_batch(self, batch: dict, seq2seq: bool, factor: float, sync: bool) -> torch.Tensor:
        if self.stages is None:
            return super().run_batch(batch, seq2seq, factor, sync)
        with self.engine.syncing(False):  # a schedule's `chunks` backward passes accumulate
            loss = self.stages.run_batch(batch, seq2seq, factor, sync)
        if sync:
            self.stages.finish_backward()  # tied copies' gradients summed over their stages first
            self.engine.land()
        return loss

    def eval_batch(self, batch: dict, seq2seq: bool) -> tuple[float, int]:
        return (self.stages or super()).eval_batch(batch, seq2seq)

    def attach_optimizer(self, cls, **kw) -> None:
        self.engine.attach(cls, **kw)

    def set_loss(self, fn) -> None:
        super().set_loss(fn)
        if self.stages is not None:  # they run the micro-batches
            self.stages.set_loss(fn)

    def set_lr(self, lr: float) -> None:
        self.engine.param_groups[0]["lr"] = lr  # before backward: the engine may step during it

    def update(self, max_norm: float, loss_scale: float) -> float:
        return self.engine.clip_and_step(max_norm, loss_scale)  # unscales and clips inside its host step

    def flush(self) -> None:
        self.engine.flush()

    def checkpoint_state(self, loading: bool = False) -> dict:
        state = self.engine.checkpoint_state(self.module)
        return {**state, "model": self.saved_model(state["model"])}

    def loading(self, saved: Mapping) -> Loading:
        out = self.engine.loading(self.module, saved)
        out.state["model"] = self.saved_model(out.state["model"])
        return out

    def after_load(self, state: dict) -> None:
        self.engine.reload_params()  # the host masters were loaded in place; the device copies follow

    def memory_tensors(self) -> dict:
        """Host master weights count as optimizer state (they exist only for the optimizer)."""
        params = list(self.model.parameters())
        states = [v for st in self.engine.state.values() for v in st.values()]
        return {"params": params, "grads": [p.grad for p in params] + list(self.engine.grad_buffers or ()),
                "optimizer": states + list(self.engine.masters)}


def apply_offload(model: torch.nn.Module, name: str, rt, compute: torch.dtype | None, *, delayed: bool,
                  nvme_dir, eager: bool = False, nvme_host_bytes: float = 0, grads_on_device: bool = False,
                  stages: Applied | None = None, tied: list = (), weights=None,
                  state_format: str = "fp32") -> OffloadApplied:
    """`eager`: the job neither clips nor scales its loss (so the engine may step during backward).
    `stages`: this rank's pipeline stages (their engine runs the micro-batches; the offload engine
    updates their parameters), with `tied`: (parameter, counted here) for copies held on several stages.
    `weights`: where a meta model's values come from on this rank (loading.WholeParams); None: the
    first data-parallel rank's, broadcast. `state_format`: the moments' (statefmt.py)."""
    engine = OffloadEngine(model, rt, compute, delayed=delayed, eager=eager, nvme_dir=nvme_dir, weights=weights,
                           state_format=state_format,
                           nvme_host_bytes=nvme_host_bytes, grads_on_device=grads_on_device,
                           held=frozenset(id(p) for p, _ in tied),
                           uncounted=frozenset(id(p) for p, counted in tied if not counted))
    notes = [f"offload engine: {len(engine.buckets)} buckets" + (", delayed update" if delayed else "") +
             (f", {state_format} optimizer states" if state_format != "fp32" else "") +
             (f" over {rt.data.world_size} data-parallel ranks of each stage" if stages else "")]
    if stages is None:
        return OffloadApplied(model=model, module=model, strategy=name, notes=notes, engine=engine)
    return OffloadApplied(model=stages.model, module=stages.module, strategy=name, notes=stages.notes + notes,
                          engine=engine, stages=stages, generates=stages.generates)

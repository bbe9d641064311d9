"""Running the stages with torch.distributed.pipelining, as the training loop's `Applied`.

- Every rank sees the whole batch (pure pipeline: no data parallelism), so the data view of the
  job is one rank (`data_runtime`) and the loop's global-batch arithmetic stays as it is.
- Each micro-batch of the loop is one schedule step of `chunks` pipeline micro-batches. The loss
  is the loop's own (train/step.py `token_loss`: summed token cross-entropy from fp32 logits)
  computed on the last stage, times the loop's factor (loss scale / global-batch tokens), so the
  gradients are those of the token mean over the global batch, as for every other strategy.
- A schedule's stages learn the shapes of what travels at their first step and keep them, so one
  schedule is kept per batch shape (sequence lengths padded up to a multiple of PAD_TO, few shapes).
- Tied parameters held on several ranks get their gradients summed over those ranks (one process
  group per tied parameter) before the update, so the copies take identical steps and stay equal.
- The gradient norm for clipping is global: squared norms all-reduced over the stages, each tied
  parameter counted once (on its lowest rank), as the single-process model counts it.
"""
from __future__ import annotations

import functools
import inspect
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.tokenize import IGNORE
from ..distributed import Runtime
from ..strategies.base import Applied
from ..train.step import target_tokens, token_loss
from .cut import PipelineLayout

PAD_TO = 8  # sequence lengths are padded to a multiple of this: fewer shapes, fewer schedules
MAX_SCHEDULES = 8  # per mode; each holds receive buffers for every chunk, so old shapes are dropped


@dataclass
class PipelineApplied(Applied):
    stage_modules: list = field(default_factory=list)  # this rank's StageModules
    layout: PipelineLayout | None = None
    tied: list = field(default_factory=list)  # (parameter, process group, counted here) per tied group
    device: torch.device | None = None
    generates: bool = False  # generate() would need every stage in one process: use the consolidated model
    flat_optimizer_state: bool = True  # checkpoints key optimizer settings by parameter (ranks differ)

    def __post_init__(self):
        self._schedules: OrderedDict = OrderedDict()
        self._sums: list[torch.Tensor] = []
        self._factor = 1.0

    def data_runtime(self, rt: Runtime) -> Runtime:
        """Every pipeline rank reads the whole global batch."""
        return Runtime(rank=0, world_size=1, local_rank=rt.local_rank, device=rt.device)

    # -- forward and backward ----------------------------------------------------------------
    def run_batch(self, batch: dict, seq2seq: bool, factor: float) -> torch.Tensor:
        """One micro-batch through every stage, forward and backward; its summed token loss on the
        last stage's rank, zero elsewhere."""
        return self._run(batch, seq2seq, factor, train=True)

    @torch.no_grad()
    def eval_batch(self, batch: dict, seq2seq: bool) -> tuple[float, int]:
        """(summed token loss, target tokens), both counted on the last stage's rank only, so that
        a sum over all ranks gives the batch's figures."""
        rows = batch["labels"].shape[0]
        batch = _fill_rows(batch, -rows % self.layout.chunks)
        loss = self._run(batch, seq2seq, 1.0, train=False)
        return (loss.item(), target_tokens(batch["labels"], seq2seq)) if self._holds_last else (0.0, 0)

    def _run(self, batch: dict, seq2seq: bool, factor: float, train: bool) -> torch.Tensor:
        inputs = _pad(batch, seq2seq)
        schedule = self._schedule(train, seq2seq, inputs)
        self._factor, self._sums = factor, []
        kwargs = {"attention_mask": inputs["attention_mask"]}
        if seq2seq:
            kwargs["decoder_input_ids"] = self.module.prepare_decoder_input_ids_from_labels(labels=inputs["labels"])
        args = (inputs["input_ids"],) if self._holds_first else ()
        if "return_outputs" in inspect.signature(schedule.step).parameters:
            kwargs["return_outputs"] = False  # the logits are needed for the loss only
        (schedule.step if train else schedule.eval)(*args, target=inputs["labels"], **kwargs)
        # some torch versions also run the loss once while learning shapes: the last `chunks` are the step's
        sums = self._sums[-self.layout.chunks:] if self._holds_last else []
        return torch.stack(sums).double().sum() if sums else torch.zeros((), dtype=torch.float64, device=self.device)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, seq2seq: bool) -> torch.Tensor:
        loss = token_loss(logits, labels, seq2seq)
        self._sums.append(loss.detach())
        return loss * self._factor

    def _schedule(self, train: bool, seq2seq: bool, inputs: dict):
        key = (train, tuple((k, tuple(v.shape)) for k, v in sorted(inputs.items())))
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        stages = [PipelineStage(m, m.index, self.layout.stages, self.device) for m in self.stage_modules]
        loss = functools.partial(self._loss, seq2seq=seq2seq)
        if self.layout.schedule == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, self.layout.chunks, loss_fn=loss, scale_grads=False)
        else:
            cls = Schedule1F1B if self.layout.schedule == "1f1b" else ScheduleGPipe
            schedule = cls(stages[0], self.layout.chunks, loss_fn=loss, scale_grads=False)
        self._schedules[key] = schedule
        if sum(k[0] == train for k in self._schedules) > MAX_SCHEDULES:
            del self._schedules[next(k for k in self._schedules if k[0] == train)]
        return schedule

    @property
    def _holds_first(self) -> bool:
        return any(m.index == 0 for m in self.stage_modules)

    @property
    def _holds_last(self) -> bool:
        return any(m.is_last for m in self.stage_modules)

    # -- before the update -------------------------------------------------------------------
    def finish_backward(self) -> None:
        """Sum each tied parameter's gradient over the ranks holding a copy of it."""
        for p, group, _ in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)

    def clip_grad_norm(self, params: list, max_norm: float) -> float:
        """The global gradient norm over all stages (tied copies counted once); clip by it."""
        copies = {id(p) for p, _, counted in self.tied if not counted}
        counted = [p.grad for p in params if id(p) not in copies]
        local = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=self.device)
        squared = local.double().square()
        dist.all_reduce(squared)
        total = squared.sqrt().float()
        if max_norm > 0 and math.isfinite(total.item()):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total.item()


def _pad(batch: dict, seq2seq: bool) -> dict:
    """Sequence lengths up to a multiple of PAD_TO: padded positions are masked and carry no label,
    so the loss is unchanged, and the schedules see fewer shapes."""
    out = dict(batch)
    width = batch["input_ids"].shape[1]
    extra = -width % PAD_TO
    if extra:
        out["input_ids"] = F.pad(batch["input_ids"], (0, extra), value=0)
        out["attention_mask"] = F.pad(batch["attention_mask"], (0, extra), value=0)
        if not seq2seq:
            out["labels"] = F.pad(batch["labels"], (0, extra), value=IGNORE)
    if seq2seq:
        out["labels"] = F.pad(batch["labels"], (0, -batch["labels"].shape[1] % PAD_TO), value=IGNORE)
    return out


def _fill_rows(batch: dict, n: int) -> dict:
    """`n` more rows, copies of the first with no labels: evaluation batches split evenly into chunks."""
    if not n:
        return batch
    out = {k: torch.cat([v, v[:1].expand(n, *v.shape[1:])]) for k, v in batch.items()}
    out["labels"][-n:] = IGNORE
    return out

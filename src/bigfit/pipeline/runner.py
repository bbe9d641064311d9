"""Running the stages with torch.distributed.pipelining, as the training loop's `Applied`.

- Every pipeline position of one data-parallel replica sees that replica's whole share of the
  batch (the data view of the mesh, layout/mesh.py), so the loop's global-batch arithmetic stays
  as it is. Over data-parallel replicas, the stages' gradients are averaged each step (DDP's
  all-reduce, `finish_backward`; with ZeRO-1 each replica then steps the states it owns,
  `ZeroOneStages`), or FSDP2 shards each stage's blocks (`shard_stages`), or the offload engine
  takes the update over (offload/strategy.py: this engine still runs the schedules).
- Each micro-batch of the loop is one schedule step of `chunks` pipeline micro-batches. The loss
  is the loop's own (training/step.py `token_loss`: summed token cross-entropy from fp32 logits)
  computed on the last stage, times the loop's factor (loss scale / global-batch tokens), so the
  gradients are those of the token mean over the global batch, as for every other strategy.
- A schedule's stages learn the shapes of what travels at their first step and keep them, so one
  schedule is kept per batch shape (sequence lengths padded up to a multiple of PAD_TO, few shapes).
- Tied parameters held on several ranks get their gradients summed over those ranks (one process
  group per tied parameter) before the update, so the copies take identical steps and stay equal.
- The gradient norm for clipping is global (engine/norms.py): squared norms all-reduced over the
  ranks, each tied parameter counted once (on its lowest position), as the single-process model counts it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions


from ..common.distributed import Runtime
from ..data.tokenize import IGNORE
from ..data_parallel.sharding import ZeroOneStates, fsdp_options, shard_units
from ..engine.losses import target_tokens, token_loss
from ..engine.norms import clip_by, global_norm
from ..engine.protocol import Applied, local
from ..layout.cut import PipelineLayout

PAD_TO = 8  # sequence lengths are padded to a multiple of this: fewer shapes, fewer schedules
MAX_SCHEDULES = 8  # per mode; each holds receive buffers for every chunk, so old shapes are dropped


@dataclass
class PipelineApplied(Applied):
    stage_modules: list = field(default_factory=list)  # this rank's StageModules
    layout: PipelineLayout | None = None
    tied: list = field(default_factory=list)  # (parameter name, process group, counted here) per tied group
    device: torch.device | None = None
    generates: bool = False  # generate() would need every stage in one process: use the consolidated model
    group: object = None  # the process group of this rank's pipeline (its pp dimension)
    replicas: object = None  # the data-parallel group whose gradients DDP-style averaging combines
    ranks_per_position: int = 1  # ranks holding each pipeline position (data- and tensor-parallel peers)
    shapes: object = None  # the data-parallel group that must agree on batch shapes (FSDP2 over the stages)

    def __post_init__(self):
        self._schedules: OrderedDict = OrderedDict()
        self._sums: list[torch.Tensor] = []
        self._factor = 1.0

    def state_options(self) -> StateDictOptions:
        """Pipeline ranks hold different parameters: their optimizer's param_groups, one list per rank
        under the same key, would overwrite each other in DCP; flattened, every entry is keyed by its
        parameter."""
        return StateDictOptions(flatten_optimizer_state_dict=True)

    def shard_stages(self, plan, rt: Runtime, compute: torch.dtype | None, reduce: torch.dtype) -> "PipelineApplied":
        """Data parallelism over this rank's stages: FSDP2 units over the kept blocks and the root
        (ZeRO-2/3), or gradients averaged over the replicas after backward (DDP), their optimizer
        states sharded among them for ZeRO-1. Returns the engine that runs it."""
        if plan.engine != "fsdp":
            self.replicas = rt.data.group
            if plan.zero != 1:
                return self
            engine = ZeroOneStages(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
            engine.states_group = rt.data.group
            engine.notes.append(f"ZeRO-1 over {plan.dp} data-parallel ranks on each stage")
            return engine
        self.shapes = rt.data.group
        # the root unit is the stage, not the model: a stage ends the model's forward early (stage.py),
        # so hooks FSDP2 runs after the model's forward would never run, nor its root's backward
        shard_units(self.model, self.stage_modules[0], fsdp_options(plan, rt, compute, reduce))
        self.notes.append(f"FSDP2 (ZeRO-{plan.zero}) over {plan.dp} data-parallel rank(s) on each stage"
                          + ("; parameters, gradients and optimizer states in host RAM" if plan.offload_params else ""))
        return self

    # -- forward and backward ----------------------------------------------------------------
    def run_batch(self, batch: dict, seq2seq: bool, factor: float, sync: bool) -> torch.Tensor:
        """One micro-batch through every stage, forward and backward; its summed token loss on the
        last stage's rank, zero elsewhere."""
        return self._run(batch, seq2seq, factor, train=True)

    @torch.no_grad()
    def eval_batch(self, batch: dict, seq2seq: bool) -> tuple[float, int]:
        """(summed token loss, target tokens), both counted on the last stage's rank only, so that
        a sum over all ranks gives the batch's figures."""
        rows, = self._common(batch["labels"].shape[0])
        batch = _fill_rows(batch, rows - batch["labels"].shape[0] + (-rows % self.layout.chunks))
        loss = self._run(batch, seq2seq, 1.0, train=False)
        return (loss.item(), target_tokens(batch["labels"], seq2seq)) if self._holds_last else (0.0, 0)

    def _common(self, *sizes: int) -> list[int]:
        """The largest of each size over the data-parallel ranks whose stages FSDP2 shards: they must
        run the same schedules (a new batch shape builds a new one, and its first step runs its stages
        once more), or their FSDP2 collectives would not pair up."""
        if self.shapes is None:
            return list(sizes)
        t = torch.tensor(sizes, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.shapes)
        return t.tolist()

    def _run(self, batch: dict, seq2seq: bool, factor: float, train: bool) -> torch.Tensor:
        inputs = _pad(batch, seq2seq, *self._common(batch["input_ids"].shape[1], batch["labels"].shape[1]))
        fresh = self._key(train, inputs) not in self._schedules
        schedule = self._schedule(train, seq2seq, inputs)
        self._factor, self._sums = factor, []
        kwargs = {k: inputs[k] for k in ("attention_mask", "position_ids") if k in inputs}  # packed: positions
        if seq2seq:
            kwargs["decoder_input_ids"] = self.module.prepare_decoder_input_ids_from_labels(labels=inputs["labels"])
        args = (inputs["input_ids"],) if self._holds_first else ()
        if "return_outputs" in inspect.signature(schedule.step).parameters:
            kwargs["return_outputs"] = False  # the logits are needed for the loss only
        with self._keeping_grads(fresh):
            (schedule.step if train else schedule.eval)(*args, target=inputs["labels"], **kwargs)
        # some torch versions also run the loss once while learning shapes: the last `chunks` are the step's
        sums = self._sums[-self.layout.chunks:] if self._holds_last else []
        return torch.stack(sums).double().sum() if sums else torch.zeros((), dtype=torch.float64, device=self.device)

    @contextlib.contextmanager
    def _keeping_grads(self, fresh: bool):
        """A new schedule's first step learns its shapes by a real forward and backward, after which
        torch clears the gradients of FSDP2 modules, also those that earlier micro-batches of this
        step accumulated: they are set aside for that step and added back after it."""
        kept = {}
        if fresh and self.shapes is not None:
            kept = {p: p.grad for p in self.model.parameters() if p.grad is not None}
            for p in kept:
                p.grad = None
        try:
            yield
        finally:
            for p, g in kept.items():
                p.grad = g if p.grad is None else p.grad + g

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, seq2seq: bool) -> torch.Tensor:
        if self.loss_fn is not None:  # the user's loss of one chunk: the micro-batch's is their mean
            loss = self.loss_fn(logits, labels)
            self._sums.append(loss.detach() / self.layout.chunks)
            return loss * self._factor / self.layout.chunks
        loss = token_loss(logits, labels, seq2seq)
        self._sums.append(loss.detach())
        return loss * self._factor

    @staticmethod
    def _key(train: bool, inputs: dict) -> tuple:
        return train, tuple((k, tuple(v.shape)) for k, v in sorted(inputs.items()))

    def _schedule(self, train: bool, seq2seq: bool, inputs: dict):
        key = self._key(train, inputs)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        stages = [PipelineStage(m, m.index, self.layout.stages, self.device, group=self.group)
                  for m in self.stage_modules]
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
        """Sum each tied parameter's gradient over the ranks holding a copy of it; average every
        gradient over the data-parallel replicas (the loop's factor counted them: a mean, as DDP's)."""
        for p, group, _ in self.tied_params():
            if not p.requires_grad:  # a frozen (LoRA base) embedding has no gradient to combine
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(local(p.grad), group=group)  # the copies are sharded alike (FSDP2 over the stages)
        if self.replicas is not None:
            n = dist.get_world_size(self.replicas)
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(local(p.grad), group=self.replicas)  # tensor-parallel pieces: each its own
                    p.grad.div_(n)

    def tied_params(self) -> list:
        """(parameter, group, counted) now: sharding replaces the parameter objects, never their names."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return [(params[name], group, counted) for name, group, counted in self.tied]

    def clip_grad_norm(self, params: list, max_norm: float) -> float:
        """The global gradient norm over all stages (tied copies counted once); clip by it."""
        copies = {id(p) for p, _, counted in self.tied_params() if not counted}
        return clip_by(params, max_norm, global_norm(params, self.ranks_per_position, copies))


@dataclass
class ZeroOneStages(ZeroOneStates, PipelineApplied):
    """Replicated stages whose optimizer states are sharded over the replicas (DeepSpeed's PP x ZeRO-1)."""


def _pad(batch: dict, seq2seq: bool, width: int, target_width: int) -> dict:
    """Sequence lengths up to `width` (`target_width` for T5's labels), rounded up to a multiple of
    PAD_TO: padded positions are masked and carry no label, so the loss is unchanged, and the
    schedules see fewer shapes."""
    out = dict(batch)
    extra = width - batch["input_ids"].shape[1] + (-width % PAD_TO)
    if extra:
        out["input_ids"] = F.pad(batch["input_ids"], (0, extra), value=0)
        for key in ("attention_mask", "position_ids"):  # packed: each padded position a part of its own
            if key in batch:
                out[key] = F.pad(batch[key], (0, extra), value=0)
        if not seq2seq:
            out["labels"] = F.pad(batch["labels"], (0, extra), value=IGNORE)
    if seq2seq:
        more = target_width - batch["labels"].shape[1] + (-target_width % PAD_TO)
        out["labels"] = F.pad(batch["labels"], (0, more), value=IGNORE)
    return out


def _fill_rows(batch: dict, n: int) -> dict:
    """`n` more rows, copies of the first with no labels: evaluation batches split evenly into chunks."""
    if not n:
        return batch
    out = {k: torch.cat([v, v[:1].expand(n, *v.shape[1:])]) for k, v in batch.items()}
    out["labels"][-n:] = IGNORE
    return out

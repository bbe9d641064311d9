"""The resolved job: `resolve` turns validated settings into a `Job`, every derived value decided
(the parallel plan, how the global batch splits into data-parallel ranks x accumulation x
micro-batches, precision, the pipeline's schedule and chunks), once, by whoever starts the job: the
launcher, torchrun's rank 0, the Python API. The job is written into the run directory (`write`,
OUTPUT/job.json) and every worker reads it (`read`): no worker parses argv, validates or resolves.

The layout rules live in one place, `ParallelPlan` (layout/plan.py): what is checked here is the
batch arithmetic alone, which needs the plan's data-parallel degree.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BigfitError
from ..layout.cut import PipelineLayout
from ..layout.plan import ParallelPlan, plan_for
from ..settings.config import TrainConfig, auto_precision, pipeline_defaults

JOB_FILE = "job.json"  # in the output directory: the job its processes run
VERSION = 1  # of job.json's layout


@dataclass(frozen=True)
class Batching:
    """How the global batch is split: world x (data-parallel ranks x accumulation x micro-batch)."""
    world_size: int  # processes in the job
    data_parallel: int  # ranks the global batch is divided over (pipeline and TP peers read the same samples)
    per_rank: int  # samples each data-parallel rank takes a step
    grad_accum: int  # micro-batches each rank runs a step


@dataclass(frozen=True)
class DataRef:
    """The tokenized training data as the job's starter left it for its workers to map, and what the
    planner read of it."""
    tokenized: str | None = None  # the directory of the tokenized samples (data/handoff.py, or a cache entry)
    lengths: tuple[int, int] | None = None  # the longest sample's source and target tokens (capped by the limits)
    sha256: str | None = None  # the examples' digest where --data is no single file (runinfo.identity)


@dataclass(frozen=True)
class Job:
    """One job, resolved: its settings with every "auto" and None decided, its plan and batch split,
    where its tokenized data is. Made once; read by every process that runs it."""
    cfg: TrainConfig
    plan: ParallelPlan
    batching: Batching
    data: DataRef = field(default_factory=DataRef)
    # batch sizes a micro-batch probe decides after the output directory is claimed (resume compares
    # the rest): "batch_size", "micro_batch_size"
    undecided: tuple[str, ...] = ()
    prediction: str | None = None  # the planner's row for this job on this machine, as `bigfit plan` rates it

    def to_json(self) -> dict:
        return {"version": VERSION, "cfg": self.cfg.to_dict(), "plan": self.plan.to_dict(),
                "batching": dataclasses.asdict(self.batching), "data": dataclasses.asdict(self.data),
                "undecided": list(self.undecided), "prediction": self.prediction}

    @classmethod
    def from_json(cls, d: dict) -> Job:
        if d.get("version") != VERSION:
            raise BigfitError(f"job file of layout {d.get('version')!r}, this bigfit reads {VERSION}: start the job again")
        data = d["data"]
        lengths = tuple(data["lengths"]) if data.get("lengths") else None
        return cls(TrainConfig(**d["cfg"]), ParallelPlan(**d["plan"]), Batching(**d["batching"]),
                   DataRef(data.get("tokenized"), lengths, data.get("sha256")), tuple(d.get("undecided", ())),
                   d.get("prediction"))

    def with_data(self, data: DataRef) -> Job:
        return dataclasses.replace(self, data=data)


def write(job: Job, path: Path) -> Path:
    """The job as JSON at `path`, whole or not at all (written aside, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(job.to_json(), indent=1))
    tmp.replace(path)
    return path


def read(path: Path) -> Job:
    return Job.from_json(json.loads(Path(path).read_text()))


def resolve(cfg: TrainConfig, world_size: int, undecided: tuple[str, ...] = ()) -> Job:
    """The job of validated settings `cfg` on `world_size` processes. The global batch never changes
    here: only how it is split into data-parallel ranks x gradient-accumulation steps x micro-batches."""
    if "auto" in (cfg.strategy, cfg.batch_size, cfg.micro_batch_size):
        raise BigfitError("'auto' strategy and batch sizes are planned before the job is resolved (bigfit train does)")
    degrees = plan_for(cfg.strategy, world_size, tp=cfg.tp, pp=cfg.pp, dp_shard=cfg.dp_shard,
                       dp_replicate=cfg.dp_replicate, cp=cfg.cp)
    data_ranks = degrees.dp  # pipeline, context- and tensor-parallel peers see the same samples
    per_rank, micro = _split(cfg, data_ranks)
    out = dataclasses.replace(cfg, micro_batch_size=micro, precision=cfg.precision or auto_precision(),
                              # auto is --strategy auto's to decide (commands/train.py); a named strategy keeps fp32
                              optimizer_states="fp32" if cfg.optimizer_states == "auto" else cfg.optimizer_states)
    if degrees.pp > 1:
        out = _resolve_pipeline(out, degrees.pp, micro)
    # the degrees' plan with what the micro-batch decided (checked again as a whole)
    plan = dataclasses.replace(degrees, chunks=out.chunks or 1, schedule=out.pipeline_schedule,
                               stages_per_rank=out.stages_per_rank or 1, sequence_parallel=cfg.sequence_parallel,
                               compile=cfg.compile, **activation_plan(cfg))
    out = dataclasses.replace(out, chunks=plan.chunks)
    return Job(out, plan, Batching(world_size, data_ranks, per_rank, per_rank // micro), undecided=undecided)


def activation_plan(cfg: TrainConfig) -> dict:
    """The plan's fields for how activations are kept. --activation-checkpointing is checkpoint; an
    "auto" still undecided here (the planner decides it before resolving: commands/decide.py) keeps them."""
    how = "checkpoint" if cfg.activation_checkpointing and cfg.activations == "auto" else cfg.activations
    return dict(checkpointing=how in ("checkpoint", "offload"), offload_activations=how == "offload",
                checkpoint_blocks=cfg.checkpoint_blocks if how in ("checkpoint", "offload") else None)


def _split(cfg: TrainConfig, data_ranks: int) -> tuple[int, int]:
    """(samples per data-parallel rank, micro-batch), or one line saying what would divide."""
    if cfg.batch_size % data_ranks:
        raise BigfitError(
            f"--batch-size {cfg.batch_size} is not divisible by the {data_ranks} data-parallel processes; "
            f"use a multiple of {data_ranks}")
    per_rank = cfg.batch_size // data_ranks
    micro = cfg.micro_batch_size or per_rank
    if per_rank % micro:
        raise BigfitError(
            f"--micro-batch-size {micro} does not divide the per-process batch {per_rank} "
            f"(--batch-size {cfg.batch_size} / {data_ranks} data-parallel processes); valid: "
            + ", ".join(str(d) for d in range(1, per_rank + 1) if per_rank % d == 0))
    if (cfg.chunks or 1) > micro:
        raise BigfitError(f"--chunks {cfg.chunks} splits each micro-batch of {micro} samples; use at most {micro} "
                          "(or a larger --micro-batch-size)")
    return per_rank, micro


def _resolve_pipeline(cfg: TrainConfig, positions: int, micro: int) -> TrainConfig:
    if cfg.chunks is not None and micro % cfg.chunks:
        divisors = [d for d in range(1, micro + 1) if micro % d == 0]
        raise BigfitError(f"--chunks {cfg.chunks} must divide the micro-batch of {micro} samples evenly (pipeline "
                          f"stages keep one shape per chunk); valid: {', '.join(map(str, divisors))}")
    schedule, per, chunks = pipeline_defaults(cfg.pipeline_schedule, cfg.stages_per_rank, cfg.chunks, positions, micro)
    PipelineLayout(world=positions, stages_per_rank=per, schedule=schedule, chunks=chunks)  # checks
    return dataclasses.replace(cfg, chunks=chunks, pipeline_schedule=schedule, stages_per_rank=per)

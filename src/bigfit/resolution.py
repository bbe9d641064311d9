"""`resolve`: a validated TrainConfig with every derived value filled for the job's world size (the
parallel plan, the micro-batch, gradient accumulation, precision, the pipeline's schedule and chunks).
Above config.py and checks.py: the settings are read (settings.py), checked (checks.py), then
resolved here. The plan itself is parallel/plan.py's, stored in `extra["plan"]` and rebuilt by
`plan_of`, so every process of a job runs the very plan its launcher printed."""
from __future__ import annotations

import dataclasses

from .checks import validate
from .config import TrainConfig, auto_precision, pipeline_defaults
from .errors import BigfitError
from .parallel.plan import ParallelPlan, plan_for
from .pipeline.cut import PipelineLayout


def resolve(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Fill every derived value for `world_size` processes. The global batch never changes here:
    only how it is split into data-parallel ranks x gradient-accumulation steps x micro-batches."""
    validate(cfg)
    if "auto" in (cfg.strategy, cfg.batch_size, cfg.micro_batch_size):
        raise BigfitError("'auto' strategy and batch sizes are planned before the job is resolved (bigfit train does)")
    degrees = plan_for(cfg.strategy, world_size, tp=cfg.tp, pp=cfg.pp, dp_shard=cfg.dp_shard,
                       dp_replicate=cfg.dp_replicate, chunks=cfg.chunks or 1)
    data_ranks = degrees.dp  # pipeline and tensor-parallel peers see the same samples
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
    out = dataclasses.replace(cfg, micro_batch_size=micro, precision=cfg.precision or auto_precision(),
                              chunks=cfg.chunks or 1, extra=dict(cfg.extra),
                              # auto is --strategy auto's to decide (training/command.py); a named strategy keeps fp32
                              optimizer_states="fp32" if cfg.optimizer_states == "auto" else cfg.optimizer_states)
    if degrees.pp > 1 or cfg.strategy == "pipeline":
        out = _resolve_pipeline(dataclasses.replace(out, chunks=cfg.chunks), degrees.pp, micro)
    plan = plan_for(cfg.strategy, world_size, tp=cfg.tp, pp=cfg.pp, dp_shard=cfg.dp_shard,
                    dp_replicate=cfg.dp_replicate, chunks=out.chunks,
                    schedule=out.pipeline_schedule if degrees.pp > 1 else None,
                    stages_per_rank=out.stages_per_rank or 1, sequence_parallel=cfg.sequence_parallel,
                    checkpointing=cfg.activation_checkpointing,
                    compile=cfg.compile)
    out.extra.update(world_size=world_size, per_rank_batch=per_rank, grad_accum=per_rank // micro,
                     data_parallel=data_ranks, plan=plan.to_dict())
    return out


def plan_of(cfg: TrainConfig) -> ParallelPlan:
    """The plan of a resolved config."""
    return ParallelPlan(**cfg.extra["plan"])


def _resolve_pipeline(cfg: TrainConfig, positions: int, micro: int) -> TrainConfig:
    if positions < 2:
        raise BigfitError("--strategy pipeline runs one process per stage: use --nproc 2 or more (or device_map, "
                          "which splits the model over the devices of one process)")
    if cfg.chunks is not None and micro % cfg.chunks:
        divisors = [d for d in range(1, micro + 1) if micro % d == 0]
        raise BigfitError(f"--chunks {cfg.chunks} must divide the micro-batch of {micro} samples evenly (pipeline "
                          f"stages keep one shape per chunk); valid: {', '.join(map(str, divisors))}")
    schedule, per, chunks = pipeline_defaults(cfg.pipeline_schedule, cfg.stages_per_rank, cfg.chunks, positions, micro)
    PipelineLayout(world=positions, stages_per_rank=per, schedule=schedule, chunks=chunks)  # checks
    return dataclasses.replace(cfg, chunks=chunks, pipeline_schedule=schedule, stages_per_rank=per)

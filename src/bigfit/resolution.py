"""`resolve`: a validated TrainConfig with every derived value filled for the job's world size (the
micro-batch, gradient accumulation, precision, the pipeline's schedule and chunks). Above config.py
and checks.py: the settings are read (settings.py), checked (checks.py), then resolved here."""
from __future__ import annotations

import dataclasses

from .checks import validate
from .config import TrainConfig, auto_precision, pipeline_defaults
from .errors import BigfitError


def resolve(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Fill every derived value for `world_size` processes. The global batch never changes here:
    only how it is split into processes x gradient-accumulation steps x micro-batches."""
    validate(cfg)
    if "auto" in (cfg.strategy, cfg.batch_size, cfg.micro_batch_size):
        raise BigfitError("'auto' strategy and batch sizes are planned before the job is resolved (bigfit train does)")
    data_ranks = 1 if cfg.strategy == "pipeline" else world_size  # every pipeline stage sees the whole batch
    if cfg.batch_size % data_ranks:
        raise BigfitError(
            f"--batch-size {cfg.batch_size} is not divisible by the {world_size} processes; "
            f"use a multiple of {world_size}")
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
                              chunks=cfg.chunks or 1, extra=dict(cfg.extra))
    if cfg.strategy == "pipeline":
        out = _resolve_pipeline(dataclasses.replace(out, chunks=cfg.chunks), world_size, micro)
    out.extra.update(world_size=world_size, per_rank_batch=per_rank, grad_accum=per_rank // micro,
                     data_parallel=data_ranks)
    return out


def _resolve_pipeline(cfg: TrainConfig, world_size: int, micro: int) -> TrainConfig:
    if cfg.pipeline_degree not in (None, world_size):
        raise BigfitError(f"--pipeline-degree {cfg.pipeline_degree} of {world_size} processes would run "
                          f"{world_size / cfg.pipeline_degree:g} pipelines side by side (data parallel over "
                          f"pipelines), which is not supported yet; use --pipeline-degree {world_size} (every "
                          "process one pipeline position), or zero3 / ddp for data parallelism")
    if world_size < 2:
        raise BigfitError("--strategy pipeline runs one process per stage: use --nproc 2 or more (or device_map, "
                          "which splits the model over the devices of one process)")
    if cfg.chunks is not None and micro % cfg.chunks:
        divisors = [d for d in range(1, micro + 1) if micro % d == 0]
        raise BigfitError(f"--chunks {cfg.chunks} must divide the micro-batch of {micro} samples evenly (pipeline "
                          f"stages keep one shape per chunk); valid: {', '.join(map(str, divisors))}")
    schedule, per, chunks = pipeline_defaults(cfg.pipeline_schedule, cfg.stages_per_rank, cfg.chunks, world_size, micro)
    from .pipeline.cut import PipelineLayout  # here: importing the pipeline package loads torch's distributed

    PipelineLayout(world=world_size, stages_per_rank=per, schedule=schedule, chunks=chunks)  # checks
    return dataclasses.replace(cfg, chunks=chunks, pipeline_schedule=schedule, stages_per_rank=per,
                               pipeline_degree=world_size)

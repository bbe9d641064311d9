"""`--micro-batch-size auto` / `--batch-size auto`: the largest micro-batch the planner predicts to
fit, confirmed by a probe job in disposable worker processes that steps down after an out-of-memory
error (the workers exit with OOM_EXIT), so an OOM never breaks the real job's process group."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .config import TrainConfig
from .distributed import launched_by_torchrun_env
from .errors import BigfitError
from .launch import launch_local
from .planning.command import auto_micro_batch

OOM_EXIT = 3  # a worker's exit status for out-of-memory


def exit_status(e: BaseException) -> int:
    """A failed worker's exit status: OOM_EXIT for out-of-memory, 1 otherwise."""
    return OOM_EXIT if isinstance(e, torch.OutOfMemoryError) else 1


def choose_micro_batch(argv: list[str], cfg: TrainConfig, world: int, speaks: bool) -> tuple[int, int]:
    """Plan the largest micro-batch predicted to fit, then confirm it with a probe job (one step on
    the longest samples) in fresh processes, stepping down after an out-of-memory error: the probe's
    processes and process group are thrown away, so an OOM never leaves this job's broken."""
    candidates = auto_micro_batch(cfg, world)
    predicted = candidates[0]
    if launched_by_torchrun_env():  # torchrun owns the processes: no probe, the prediction stands
        if speaks:
            print(f"micro-batch auto -> {predicted[0]} (predicted {predicted[2] / 1e9:.2f} GB per GPU; "
                  "not probed under torchrun)")
        return predicted[0], predicted[1]
    for micro, batch, need in candidates:
        probe = dataclasses.replace(cfg, micro_batch_size=micro, batch_size=batch, probe_only=True)
        code = launch_local(argv, world, Path(cfg.output_dir) / "logs" / "probe", quiet=True, settings=probe.to_dict())
        if code == 0:
            print(f"micro-batch auto -> {micro}: predicted {predicted[0]} to fit ({predicted[2] / 1e9:.2f} GB per "
                  f"GPU), confirmed {micro} by a probe step ({need / 1e9:.2f} GB predicted for it)")
            return micro, batch
        if code != OOM_EXIT:
            raise BigfitError(f"the micro-batch probe failed (exit status {code}); logs in {cfg.output_dir}/logs/probe")
        print(f"micro-batch {micro}: out of memory in the probe; trying a smaller one")
    raise BigfitError("--micro-batch-size auto: even micro-batch 1 ran out of memory in the probe")

"""`bigfit train`, from the parsed settings to a running job.

The launcher (or the one process of a one-process job) takes the "auto" decisions, checks all that
needs no process (`prepare`), claims the output directory (ownership.py), and then trains in this
process or starts the workers, handing them the directory's lock. A worker, of bigfit's launcher or
of torchrun, trains its rank; under torchrun rank 0 claims the directory for the job.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from .. import autobatch, launch  # modules, not names: tests stub launch.launch_local and planner.auto_plan
from ..checks import validate
from ..config import SPLIT_STRATEGIES, TrainConfig
from ..distributed import launched_by_torchrun_env
from ..errors import BigfitError
from ..parallel.plan import ALIASES
from ..planning import auto as planner
from .ckptdir import resolve_resume
from .job import prepare, with_data_lengths
from .overwrite import given_files
from .ownership import claim


def speaks() -> bool:
    """Messages about the command line are printed once: by the launcher, or by torchrun's rank 0."""
    return "BIGFIT_ERROR_FILE" not in os.environ and os.environ.get("RANK", "0") == "0"


def world(nproc: int | None, cfg: TrainConfig) -> int:
    """Processes in the job: torchrun's WORLD_SIZE, else --nproc, else the default for the strategy."""
    return int(os.environ.get("WORLD_SIZE", 0)) or nproc or default_nproc(cfg)


def default_nproc(cfg: TrainConfig) -> int:
    if cfg.strategy in ("single", *SPLIT_STRATEGIES):
        return 1
    return torch.cuda.device_count() or 2


def check_gpus(nproc: int) -> None:
    gpus = torch.cuda.device_count()
    if gpus and nproc > gpus:
        raise BigfitError(f"--nproc {nproc} needs one GPU per process, but {gpus} are visible; use --nproc {gpus} "
                          "or fewer (or CUDA_VISIBLE_DEVICES= to run on the CPU)")


def train_command(argv: list[str], cfg: TrainConfig) -> int:
    """Run `bigfit train` with `argv` parsed into `cfg` (in a worker of bigfit's launcher: the
    launcher's decided settings). Workers get the settings decided here as a file (launch.py)."""
    if cfg.strategy == "auto" or "auto" in (cfg.batch_size, cfg.micro_batch_size):
        validate(cfg)  # every flag's one line before the data is read for the plan
        cfg = with_data_lengths(cfg)  # the planner rates the data's longest batch, not the length limits
    if cfg.strategy == "auto":
        cfg = _auto_strategy(cfg)
    if cfg.strategy == "zero2-offload-nvme" and cfg.nvme_host_gb is None:
        cfg = _nvme_fill(cfg)
    if cfg.resume and cfg.batch_size == "auto":
        cfg = _resumed_batch(cfg)
    if cfg.resume and cfg.optimizer_states == "auto" and cfg.strategy.startswith("zero2-offload"):
        cfg = _resumed_states(cfg)
    if launched_by_torchrun_env():  # a worker: of bigfit's launcher or of torchrun
        return _worker(cfg, argv)
    nproc = cfg.nproc or default_nproc(cfg)
    check_gpus(nproc)
    job = prepare(_checkable(cfg, nproc), nproc)  # every check that needs no process, before any process starts
    _check_split(job, nproc)
    # the output directory is this run's from here on, or one line says why not
    with claim(job, given=given_files(argv)) as lock:
        if "auto" in (cfg.batch_size, cfg.micro_batch_size):
            cfg = _auto_batch(cfg, argv, nproc)  # probe jobs, under this claim
        if nproc == 1:
            # `kill`, `timeout`, a scheduler's stop: as Ctrl-C, one line (cli.main), as for several processes
            with launch.stop_on_sigterm():
                _train(cfg)
            return 0
        return launch.launch_local(argv, nproc, Path(cfg.output_dir) / "logs", lock_fd=lock.fd if lock else None,
                                   settings=cfg.to_dict())


def _train(cfg: TrainConfig) -> None:
    """Train in this process, the one of a one-process job or a worker."""
    from .loop import train  # imported here: a launcher starts its workers without the training stack
    from .metrics import stop_live

    try:
        train(cfg)
    finally:
        stop_live()  # an interrupt or an error leaves the loop before it closes its live bar


def _worker(cfg: TrainConfig, argv: list[str]) -> int:
    if "auto" in (cfg.batch_size, cfg.micro_batch_size):  # under torchrun: the prediction, no probe
        cfg = _auto_batch(cfg, argv, world(cfg.nproc, cfg))
    try:
        _train(cfg)
    except Exception as e:
        if not os.environ.get("BIGFIT_ERROR_FILE"):
            raise  # under torchrun: its own error handling shows it
        launch.write_error(e)  # bigfit's launcher shows the first failure, once
        return autobatch.exit_status(e)
    return 0


def _auto_strategy(cfg: TrainConfig) -> TrainConfig:
    """`--strategy auto`: the planner's pick over the named strategies and the composed plans."""
    # device_map is one process driving every GPU: a candidate unless --nproc or torchrun fix the processes
    one_process = cfg.nproc is None and not launched_by_torchrun_env()
    name, degrees, reason = planner.auto_plan(cfg, world(cfg.nproc, cfg), one_process)
    # the degrees the alias does not fill by itself (plan.py ALIASES), so the workers resolve the same plan
    given = {d: v for d, v in degrees.items() if v > 1 and d != ALIASES[name].fills}
    if speaks():
        shown = "".join(f" --{d.replace('_', '-')} {v}" for d, v in given.items())
        print(f"--strategy auto -> {name}{shown}: {reason}")
    split = {"device_map": "auto"} if name in SPLIT_STRATEGIES else {}  # balanced as the plan was
    if name.startswith("zero2-offload") and cfg.optimizer_states == "auto":  # the format it was rated with
        given["optimizer_states"] = planner.optimizer_states(cfg, world(cfg.nproc, cfg), name)
        if speaks() and given["optimizer_states"] != "fp32":
            print(f"--optimizer-states {given['optimizer_states']}: the most exact that fits the host RAM")
    return dataclasses.replace(cfg, strategy=name, **split, **given)  # workers start from the decision, not from "auto"


def _nvme_fill(cfg: TrainConfig) -> TrainConfig:
    """zero2-offload-nvme without --nvme-host-gb: the optimizer states the host RAM holds beside the rest
    stay there (the first blocks'), as the plan rates it; only the remainder goes to the disk, which is
    slower by the ratio of the two bandwidths (DeepSpeed puts every state on the disk: --nvme-host-gb 0)."""
    gb = planner.nvme_host_gb(cfg, world(cfg.nproc, cfg))
    if speaks():
        print(f"--nvme-host-gb {gb:.4g}: the optimizer states host RAM holds beside the rest (0: every state on the disk)")
    return dataclasses.replace(cfg, nvme_host_gb=gb)


def _saved_config(cfg: TrainConfig) -> dict:
    """The settings of the checkpoint `--resume` names; {} where it cannot be read (the claim says why)."""
    try:
        return json.loads((resolve_resume(cfg.resume, cfg.output_dir) / "trainer.json").read_text())["config"]
    except (BigfitError, OSError, ValueError, KeyError, TypeError):
        return {}


def _resumed_batch(cfg: TrainConfig) -> TrainConfig:
    """`--batch-size auto` on resume is the checkpoint's global batch: another would change the math."""
    try:
        batch = int(_saved_config(cfg)["batch_size"])
    except (KeyError, ValueError, TypeError):
        return cfg
    if speaks():
        print(f"--batch-size auto on resume -> {batch}, the checkpoint's")
    return dataclasses.replace(cfg, batch_size=batch)


def _resumed_states(cfg: TrainConfig) -> TrainConfig:
    """`--optimizer-states auto` on resume keeps a compact format the checkpoint was trained with
    (fp32 states might not fit the RAM the run was planned for)."""
    states = _saved_config(cfg).get("optimizer_states")
    if states not in ("bf16", "int8"):
        return cfg
    if speaks():
        print(f"--optimizer-states auto on resume -> {states}, the checkpoint's")
    return dataclasses.replace(cfg, optimizer_states=states)


def _checkable(cfg: TrainConfig, nproc: int) -> TrainConfig:
    """`cfg` with numbers where the probe decides the batch sizes later, for the checks before it."""
    if "auto" not in (cfg.batch_size, cfg.micro_batch_size):
        return cfg
    undecided = [n for n in ("batch_size", "micro_batch_size") if getattr(cfg, n) == "auto"]
    return dataclasses.replace(cfg, micro_batch_size=1, batch_size=nproc if cfg.batch_size == "auto" else cfg.batch_size,
                               extra={**cfg.extra, "undecided": undecided})


def _check_split(job, nproc: int) -> None:
    """The plan's split against the model's stacks, on the meta device: device_map's map, the pipeline's
    cut, the tensor-parallel degree against the heads; and safetensors weights against the model,
    when each rank will read its own slices."""
    # imported here: each loads its split's stack (model classes, torch.distributed.tensor / pipelining);
    # the launcher loads only the one its plan uses
    if job.plan.split == "device_map":
        from ..device_map.strategy import check

        check(job.cfg, job.model_config)
    if job.plan.pp > 1:
        from ..pipeline.strategy import check

        check(job.cfg, job.model_config, job.plan.pp)
    if job.plan.tp > 1:
        from ..tensor import check_tensor_parallel

        check_tensor_parallel(job.model_config, job.plan.tp, job.plan.sequence_parallel)
    from ..loading import check_weights, loads_per_rank

    if loads_per_rank(job.source):
        check_weights(job.source, job.model_config)


def _auto_batch(cfg: TrainConfig, argv: list[str], nproc: int) -> TrainConfig:
    return autobatch.choose_micro_batch(argv, cfg, nproc, speaks=speaks())

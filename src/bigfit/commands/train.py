"""`bigfit train`, from the parsed settings to a running job.

The starter (bigfit's launcher, or the one process of a one-process job) takes the "auto" decisions,
resolves the job (job/resolution.py) and prepares it, checking all that needs no process (job/prepare.py),
claims the output directory (outputs/ownership.py), writes the job into it (OUTPUT/job.json) with the
tokenized data left for its workers, and then trains in this process or starts the workers, handing
them the directory's lock and the job's path: a worker parses no argv, validates and resolves
nothing, and maps the data (`run_worker`). Under torchrun every rank starts from the command line:
each node's local rank 0 makes the job and the others read it (`_torchrun_rank`); rank 0 claims the
directory for the job. The "auto" decisions before resolution are decide.py's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ..common import processes
from ..common.distributed import launched_by_torchrun_env
from ..errors import BigfitError
from ..job import autoplan as planner
from ..job.prepare import Prepared, handed_over, prepare
from ..job.resolution import JOB_FILE, Job, read, resolve, write
from ..outputs.ownership import claim
from ..settings.config import TrainConfig
from . import autobatch, decide, launch  # modules, not names: tests stub launch.launch_local


def check_gpus(nproc: int) -> None:
    gpus = torch.cuda.device_count()
    if gpus and nproc > gpus:
        raise BigfitError(f"--nproc {nproc} needs one GPU per process, but {gpus} are visible; use --nproc {gpus} "
                          "or fewer (or CUDA_VISIBLE_DEVICES= to run on the CPU)")


def train_command(argv: list[str], cfg: TrainConfig, given: dict[str, str] | None = None) -> int:
    """Run `bigfit train` with `argv` parsed into the validated `cfg`: as the job's starter, or
    under torchrun as one of its ranks. `given`: the settings files the command line named
    ({"--config": path}), which the settings keep no trace of (an --overwrite must not remove them)."""
    if launched_by_torchrun_env():
        return _torchrun_rank(cfg, argv)
    cfg, lengths = decide.decided(cfg)
    nproc = cfg.nproc or planner.default_processes(cfg)
    check_gpus(nproc)
    undecided = tuple(n for n in ("batch_size", "micro_batch_size") if getattr(cfg, n) == "auto")
    # every check that needs no process, before any process starts
    ready = prepare(resolve(_checkable(cfg, nproc), nproc, undecided))
    _check_split(ready, nproc)
    # the output directory is this run's from here on, or one line says why not
    with claim(ready, given=given or {}) as lock, _handoff(ready, nproc > 1 or bool(undecided)) as data:
        if undecided:
            cfg = decide.auto_batch(cfg, argv, nproc, ready.job.data.lengths, data)  # probe jobs, under this claim
            ready = dataclasses.replace(ready, job=resolve(cfg, nproc).with_data(ready.job.data))
        ready = dataclasses.replace(ready, job=decide.predicted(ready.job))
        write(ready.job.with_data(data or ready.job.data), Path(cfg.output_dir) / JOB_FILE)
        if nproc == 1:
            # `kill`, `timeout`, a scheduler's stop: as Ctrl-C, one line (cli.main), as for several processes
            with processes.stop_on_sigterm():
                _train(ready.job, ready)
            return 0
        return launch.launch_local(argv, nproc, Path(cfg.output_dir) / "logs", lock_fd=lock.fd if lock else None,
                                   job=Path(cfg.output_dir) / JOB_FILE)


@contextlib.contextmanager
def _handoff(ready: Prepared, workers: bool):
    """Where `ready`'s tokenized data waits for the job's workers (None when there are none): a
    temporary directory of this node's, which goes when the job ends."""
    if not workers:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="bigfit-data-") as tmp:
        yield handed_over(ready, Path(tmp) / "data").data


def run_worker(path: str) -> int:
    """A worker of bigfit's launcher: the job its launcher wrote, on this rank."""
    try:
        _train(read(Path(path)))
    except Exception as e:
        processes.write_error(e)  # bigfit's launcher shows the first failure, once
        return autobatch.exit_status(e)
    return 0


def _train(job: Job, ready: Prepared | None = None) -> None:
    """Train in this process, the one of a one-process job or a worker."""
    from ..training.loop import train  # imported here: a launcher starts its workers without the training stack
    from ..training.metrics import stop_live

    try:
        train(job, ready)
    finally:
        stop_live()  # an interrupt or an error leaves the loop before it closes its live bar


def _torchrun_rank(cfg: TrainConfig, argv: list[str]) -> int:
    """One rank of a torchrun job (torchrun, accelerate launch, SLURM's srun with torchrun's variables):
    each node's local rank 0 makes the job as a launcher would (the "auto" decisions, resolution,
    the data tokenized once) and leaves it in a directory of the node's that its other local ranks
    read. "auto" batch sizes are the prediction, unprobed: the processes are the job's."""
    where = Path(tempfile.gettempdir()) / f"bigfit-job-{_launch_key()}"
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        _train(_wait_for_job(where))
        return 0
    try:
        cfg, lengths = decide.decided(cfg)
        if "auto" in (cfg.batch_size, cfg.micro_batch_size):
            cfg = decide.auto_batch(cfg, argv, decide.world(cfg.nproc, cfg), lengths, None)
        ready = prepare(resolve(cfg, decide.world(cfg.nproc, cfg)))
        ready = dataclasses.replace(ready, job=decide.predicted(ready.job))
        job = handed_over(ready, where / "data") if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1 else ready.job
        write(job, where / JOB_FILE)
    except BaseException as e:  # the node's other ranks stop waiting and say it too
        where.mkdir(parents=True, exist_ok=True)
        (where / "error.json").write_text(json.dumps({"user": isinstance(e, BigfitError), "message": str(e)}))
        raise
    try:
        _train(job, ready)
    finally:
        shutil.rmtree(where, ignore_errors=True)  # the other ranks' maps keep the pages they use
    return 0


def _launch_key() -> str:
    """The same for every local rank of one torchrun launch on this node, another for the next launch:
    torchrun's agent is the ranks' parent, and restarts count up."""
    return f"{os.getppid()}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{os.environ.get('MASTER_PORT', '')}"


def _wait_for_job(where: Path) -> Job:
    """The job this node's local rank 0 made, once it is there, or its failure as that rank's error. No
    deadline: tokenizing a large corpus takes minutes, and torchrun stops the node's ranks if that one dies."""
    while not (where / JOB_FILE).exists():
        if (where / "error.json").exists():
            err = json.loads((where / "error.json").read_text())
            raise (BigfitError if err["user"] else RuntimeError)(err["message"])
        time.sleep(0.05)
    return read(where / JOB_FILE)


def _checkable(cfg: TrainConfig, nproc: int) -> TrainConfig:
    """`cfg` with numbers where the probe decides the batch sizes later, for the checks before it."""
    if "auto" not in (cfg.batch_size, cfg.micro_batch_size):
        return cfg
    return dataclasses.replace(cfg, micro_batch_size=1, batch_size=nproc if cfg.batch_size == "auto" else cfg.batch_size)


def _check_split(job: Prepared, nproc: int) -> None:
    """The plan's split against the model's stacks, on the meta device: device_map's map, the pipeline's
    cut, the tensor-parallel degree against the heads; and safetensors weights against the model,
    when each rank will read its own slices."""
    # imported here: each loads its split's stack (model classes, torch.distributed.tensor / pipelining);
    # the launcher loads only the one its plan uses
    if job.plan.split == "device_map":
        from ..device_map.strategy import check

        check(job.cfg, job.model_config, job.job.data.lengths)
    if job.plan.pp > 1:
        from ..pipeline.strategy import check

        check(job.cfg, job.model_config, job.plan.pp)
    if job.plan.tp > 1:
        from ..tensor import check_tensor_parallel

        check_tensor_parallel(job.model_config, job.plan.tp, job.plan.sequence_parallel)
    from ..loading import check_weights, loads_per_rank

    if loads_per_rank(job.source):
        check_weights(job.source, job.model_config)



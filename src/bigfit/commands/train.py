"""`bigfit train`, from the parsed settings to a running job.

The starter (bigfit's launcher, or the one process of a one-process job) takes the "auto" decisions,
resolves the job (job/resolution.py) and prepares it, checking all that needs no process (job/prepare.py),
claims the output directory (outputs/ownership.py), writes the job into it (OUTPUT/job.json) with the
tokenized data left for its workers, and then trains in this process or starts the workers, handing
them the directory's lock and the job's path: a worker parses no argv, validates and resolves
nothing, and maps the data (`run_worker`). Under torchrun every rank starts from the command line;
its rank 0 claims the directory for the job.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch

from ..common import processes
from . import launch  # modules, not names: tests stub launch.launch_local and planner.auto_plan
from ..common.distributed import launched_by_torchrun_env
from ..errors import BigfitError
from ..job import autoplan as planner
from ..job.prepare import Prepared, data_lengths, handed_over, prepare
from ..job.resolution import JOB_FILE, Job, read, resolve, write
from ..layout.plan import ALIASES
from ..outputs.ckptdir import resolve_resume
from ..outputs.ownership import claim
from ..settings.config import SPLIT_STRATEGIES, TrainConfig
from . import autobatch


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


def train_command(argv: list[str], cfg: TrainConfig, given: dict[str, str] | None = None) -> int:
    """Run `bigfit train` with `argv` parsed into the validated `cfg`: as the job's starter, or
    under torchrun as one of its ranks. `given`: the settings files the command line named
    ({"--config": path}), which the settings keep no trace of (an --overwrite must not remove them)."""
    if launched_by_torchrun_env():
        return _torchrun_rank(cfg, argv)
    cfg, lengths = _decided(cfg)
    nproc = cfg.nproc or default_nproc(cfg)
    check_gpus(nproc)
    undecided = tuple(n for n in ("batch_size", "micro_batch_size") if getattr(cfg, n) == "auto")
    # every check that needs no process, before any process starts
    ready = prepare(resolve(_checkable(cfg, nproc), nproc, undecided))
    _check_split(ready, nproc)
    # the output directory is this run's from here on, or one line says why not
    with claim(ready, given=given or {}) as lock, _handoff(ready, nproc > 1 or bool(undecided)) as data:
        if undecided:
            cfg = _auto_batch(cfg, argv, nproc, ready.job.data.lengths, data)  # probe jobs, under this claim
            ready = dataclasses.replace(ready, job=resolve(cfg, nproc).with_data(ready.job.data))
        ready = dataclasses.replace(ready, job=_predicted(ready.job))
        write(ready.job.with_data(data or ready.job.data), Path(cfg.output_dir) / JOB_FILE)
        if nproc == 1:
            # `kill`, `timeout`, a scheduler's stop: as Ctrl-C, one line (cli.main), as for several processes
            with processes.stop_on_sigterm():
                _train(ready.job, ready)
            return 0
        return launch.launch_local(argv, nproc, Path(cfg.output_dir) / "logs", lock_fd=lock.fd if lock else None,
                                   job=Path(cfg.output_dir) / JOB_FILE)


def _decided(cfg: TrainConfig) -> tuple[TrainConfig, tuple[int, int] | None]:
    """`cfg` with the "auto" decisions taken that come before the job is resolved (the strategy, the
    NVMe tier's share in RAM, a resumed run's batch and state format), and the data's longest sample
    where the planner rated it (the data read here is kept for `prepare`)."""
    lengths = None
    if cfg.strategy == "auto" or "auto" in (cfg.batch_size, cfg.micro_batch_size):
        lengths = data_lengths(cfg)  # the planner rates the data's longest batch, not the length limits
    if cfg.strategy == "auto":
        cfg = _auto_strategy(cfg, lengths)
    if cfg.strategy == "zero2-offload-nvme" and cfg.nvme_host_gb is None:
        cfg = _nvme_fill(cfg, lengths)
    if cfg.resume and cfg.batch_size == "auto":
        cfg = _resumed_batch(cfg)
    if cfg.resume and cfg.optimizer_states == "auto" and cfg.strategy.startswith("zero2-offload"):
        cfg = _resumed_states(cfg)
    return cfg, lengths


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
        _train(_wait_for_job(where, cfg.timeout_s))
        return 0
    try:
        cfg, lengths = _decided(cfg)
        if "auto" in (cfg.batch_size, cfg.micro_batch_size):
            cfg = _auto_batch(cfg, argv, world(cfg.nproc, cfg), lengths, None)
        ready = prepare(resolve(cfg, world(cfg.nproc, cfg)))
        ready = dataclasses.replace(ready, job=_predicted(ready.job))
        job = handed_over(ready, where / "data") if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1 else ready.job
        write(job, where / JOB_FILE)
    except BaseException as e:  # the node's other ranks stop waiting and say it too
        where.mkdir(parents=True, exist_ok=True)
        (where / "error.json").write_text(json.dumps({"user": isinstance(e, BigfitError), "message": str(e)}))
        raise
    try:
        _train(job, ready)
    finally:
        import shutil

        shutil.rmtree(where, ignore_errors=True)  # the other ranks' maps keep the pages they use
    return 0


def _launch_key() -> str:
    """The same for every local rank of one torchrun launch on this node, another for the next launch:
    torchrun's agent is the ranks' parent, and restarts count up."""
    return f"{os.getppid()}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{os.environ.get('MASTER_PORT', '')}"


def _wait_for_job(where: Path, timeout_s: float) -> Job:
    """The job this node's local rank 0 made, once it is there (or its failure, as that rank's error)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (where / JOB_FILE).exists():
        if (where / "error.json").exists():
            err = json.loads((where / "error.json").read_text())
            raise (BigfitError if err["user"] else RuntimeError)(err["message"])
        if time.monotonic() > deadline:
            raise RuntimeError(f"local rank 0 made no job in {where} within {timeout_s:g} s (--timeout-s)")
        time.sleep(0.05)
    return read(where / JOB_FILE)


def _auto_strategy(cfg: TrainConfig, lengths: tuple[int, int] | None) -> TrainConfig:
    """`--strategy auto`: the planner's pick over the named strategies and the composed plans."""
    # device_map is one process driving every GPU: a candidate unless --nproc or torchrun fix the processes
    one_process = cfg.nproc is None and not launched_by_torchrun_env()
    name, degrees, reason = planner.auto_plan(cfg, world(cfg.nproc, cfg), one_process, lengths)
    # the degrees the alias does not fill by itself (plan.py ALIASES), so the workers resolve the same plan
    given = {d: v for d, v in degrees.items() if v > 1 and d != ALIASES[name].fills}
    if speaks():
        shown = "".join(f" --{d.replace('_', '-')} {v}" for d, v in given.items())
        print(f"--strategy auto -> {name}{shown}: {reason}")
    split = {"device_map": "auto"} if name in SPLIT_STRATEGIES else {}  # balanced as the plan was
    if name.startswith("zero2-offload") and cfg.optimizer_states == "auto":  # the format it was rated with
        given["optimizer_states"] = planner.optimizer_states(cfg, world(cfg.nproc, cfg), name, lengths)
        if speaks() and given["optimizer_states"] != "fp32":
            print(f"--optimizer-states {given['optimizer_states']}: the most exact that fits the host RAM")
    return dataclasses.replace(cfg, strategy=name, **split, **given)  # workers start from the decision, not from "auto"


def _nvme_fill(cfg: TrainConfig, lengths: tuple[int, int] | None) -> TrainConfig:
    """zero2-offload-nvme without --nvme-host-gb: the optimizer states the host RAM holds beside the rest
    stay there (the first blocks'), as the plan rates it; only the remainder goes to the disk, which is
    slower by the ratio of the two bandwidths (DeepSpeed puts every state on the disk: --nvme-host-gb 0)."""
    gb = planner.nvme_host_gb(cfg, world(cfg.nproc, cfg), lengths)
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
    return dataclasses.replace(cfg, micro_batch_size=1, batch_size=nproc if cfg.batch_size == "auto" else cfg.batch_size)


def _predicted(job: Job) -> Job:
    """`job` with the planner's row for it on this machine (the start-of-run table's "prediction"):
    the row `bigfit plan` with the same settings rates. A model the planner cannot rate is a note."""
    try:
        text = planner.prediction(job.cfg, job.batching.world_size, job.data.lengths)
    except Exception as e:  # noqa: BLE001  the run goes on without it
        text = f"none: the planner could not rate this job ({type(e).__name__}: {e})"
    return dataclasses.replace(job, prediction=text or "none: the planner rates no row for this layout")


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


def _auto_batch(cfg: TrainConfig, argv: list[str], nproc: int, lengths, data) -> TrainConfig:
    return autobatch.choose_micro_batch(argv, cfg, nproc, speaks=speaks(), lengths=lengths, data=data)

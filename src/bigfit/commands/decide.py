"""The decisions a job's starter takes before it resolves the job: `--strategy auto`'s pick, how
activations are kept (`--activations auto`), the NVMe tier's share in RAM, a resumed run's batch and
state format, micro-batch auto's size (autobatch.py), each at the data's longest sample as the
planner rates it; and the planner's row for the resolved job (the start-of-run table's "prediction").
Messages about them are printed once (`speaks`)."""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from ..common.distributed import launched_by_torchrun_env
from ..errors import BigfitError
from ..job import autoplan as planner
from ..job.prepare import data_lengths
from ..job.resolution import Job
from ..layout.plan import ALIASES
from ..outputs.ckptdir import resolve_resume
from ..settings.config import SPLIT_STRATEGIES, TrainConfig
from . import autobatch


def speaks() -> bool:
    """Messages about the command line are printed once: by the launcher, or by torchrun's rank 0."""
    return "BIGFIT_ERROR_FILE" not in os.environ and os.environ.get("RANK", "0") == "0"


def world(nproc: int | None, cfg: TrainConfig) -> int:
    """Processes in the job: torchrun's WORLD_SIZE, else --nproc, else the default for the strategy."""
    return int(os.environ.get("WORLD_SIZE", 0)) or nproc or planner.default_processes(cfg)


def decided(cfg: TrainConfig) -> tuple[TrainConfig, tuple[int, int] | None]:
    """`cfg` with the "auto" decisions taken that come before the job is resolved (the strategy, the
    NVMe tier's share in RAM, a resumed run's batch and state format), and the data's longest sample
    where the planner rated it (the data read here is kept for `prepare`)."""
    lengths = None
    if undecided_activations(cfg) and not torch.cuda.is_available():
        # no GPU: activations live in the host RAM the run uses anyway, and the planner's choice is one of GPU
        # memory; nor is its trace paid (about 1 s a command on the CPU machine, every test's bigfit train)
        cfg = dataclasses.replace(cfg, activations="keep")
    if cfg.strategy == "auto" or "auto" in (cfg.batch_size, cfg.micro_batch_size) or undecided_activations(cfg):
        lengths = data_lengths(cfg)  # the planner rates the data's longest batch, not the length limits
    if cfg.strategy == "auto":
        cfg = auto_strategy(cfg, lengths)
    if undecided_activations(cfg):  # a named strategy: its row's way (auto_strategy decides its pick's)
        cfg = auto_activations(cfg, lengths)
    if cfg.strategy == "zero2-offload-nvme" and cfg.nvme_host_gb is None:
        cfg = nvme_fill(cfg, lengths)
    if cfg.resume and cfg.batch_size == "auto":
        cfg = resumed_batch(cfg)
    if cfg.resume and cfg.optimizer_states == "auto" and cfg.strategy.startswith("zero2-offload"):
        cfg = resumed_states(cfg)
    return cfg, lengths


def auto_strategy(cfg: TrainConfig, lengths: tuple[int, int] | None, processes: int | None = None,
                  one_process: bool | None = None) -> TrainConfig:
    """`--strategy auto`: the planner's pick over the named strategies and the composed plans, for the
    job's processes (`processes`: bigfit.prepare's, already running; else bigfit train's to start)."""
    # device_map is one process driving every GPU: a candidate unless --nproc or torchrun fix the processes
    if one_process is None:
        one_process = cfg.nproc is None and not launched_by_torchrun_env()
    processes = processes or world(cfg.nproc, cfg)
    name, degrees, reason = planner.auto_plan(cfg, processes, one_process, lengths)
    # the degrees the alias does not fill by itself (plan.py ALIASES), so the workers resolve the same plan
    given = {d: v for d, v in degrees.items() if v > 1 and d != ALIASES[name].fills}
    if speaks():
        shown = "".join(f" --{d.replace('_', '-')} {v}" for d, v in given.items())
        print(f"--strategy auto -> {name}{shown}: {reason}")
    split = {"device_map": "auto"} if name in SPLIT_STRATEGIES else {}  # balanced as the plan was
    if name.startswith("zero2-offload") and cfg.optimizer_states == "auto":  # the format it was rated with
        given["optimizer_states"] = planner.optimizer_states(cfg, processes, name, lengths)
        if speaks() and given["optimizer_states"] != "fp32":
            print(f"--optimizer-states {given['optimizer_states']}: the most exact that fits the host RAM")
    cfg = dataclasses.replace(cfg, strategy=name, **split, **given)  # workers start from the decision, not from "auto"
    if undecided_activations(cfg):  # the pick's way of keeping activations, on the processes it runs
        cfg = auto_activations(cfg, lengths, 1 if ALIASES[name].one_process else processes)
    return cfg


def undecided_activations(cfg: TrainConfig) -> bool:
    """--activations auto, with no --activation-checkpointing standing for checkpoint."""
    return cfg.activations == "auto" and not cfg.activation_checkpointing


def auto_activations(cfg: TrainConfig, lengths: tuple[int, int] | None, processes: int | None = None) -> TrainConfig:
    """`--activations auto`: the way the planner's row for the run's strategy and degrees keeps them
    (planning/keeping.py: keep, checkpoint the fewest blocks that fits, checkpoint all, or offload), at
    the micro-batch it rates (with micro-batch auto, the way that trains a sample fastest at the largest
    size it holds). Where the planner cannot rate the job, keep, as before --activations existed."""
    try:
        got = planner.planned_activations(cfg, processes or world(cfg.nproc, cfg), lengths)
    except Exception:  # noqa: BLE001  the run goes on keeping its activations (the prediction says why)
        got = None
    settings, why = got or ({"activations": "keep", "checkpoint_blocks": None}, "")
    if speaks() and settings["activations"] != "keep":  # keep: as every run did before --activations
        blocks = f" --checkpoint-blocks {settings['checkpoint_blocks']}" if settings["checkpoint_blocks"] else ""
        print(f"--activations auto -> {settings['activations']}{blocks}: {why}")
    return dataclasses.replace(cfg, **settings)


def nvme_fill(cfg: TrainConfig, lengths: tuple[int, int] | None) -> TrainConfig:
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


def resumed_batch(cfg: TrainConfig) -> TrainConfig:
    """`--batch-size auto` on resume is the checkpoint's global batch: another would change the math."""
    try:
        batch = int(_saved_config(cfg)["batch_size"])
    except (KeyError, ValueError, TypeError):
        return cfg
    if speaks():
        print(f"--batch-size auto on resume -> {batch}, the checkpoint's")
    return dataclasses.replace(cfg, batch_size=batch)


def resumed_states(cfg: TrainConfig) -> TrainConfig:
    """`--optimizer-states auto` on resume keeps a compact format the checkpoint was trained with
    (fp32 states might not fit the RAM the run was planned for)."""
    states = _saved_config(cfg).get("optimizer_states")
    if states not in ("bf16", "int8"):
        return cfg
    if speaks():
        print(f"--optimizer-states auto on resume -> {states}, the checkpoint's")
    return dataclasses.replace(cfg, optimizer_states=states)


def predicted(job: Job) -> Job:
    """`job` with the planner's row for it on this machine (the start-of-run table's "prediction"):
    the row `bigfit plan` with the same settings rates. A model the planner cannot rate is a note."""
    try:
        text = planner.prediction(job.cfg, job.batching.world_size, job.data.lengths)
    except Exception as e:  # noqa: BLE001  the run goes on without it
        text = f"none: the planner could not rate this job ({type(e).__name__}: {e})"
    return dataclasses.replace(job, prediction=text or "none: the planner rates no row for this layout")


def auto_batch(cfg: TrainConfig, argv: list[str], nproc: int, lengths, data) -> TrainConfig:
    return autobatch.choose_micro_batch(argv, cfg, nproc, speaks=speaks(), lengths=lengths, data=data)

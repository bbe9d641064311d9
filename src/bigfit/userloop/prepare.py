"""`bigfit.prepare(model, **settings)`: the engine `bigfit train`'s loop drives, for the user's own loop.

The settings are the job's, by the settings schema's names and rules (settings/config.py: strategy or
degrees, precision, optimizer and lr schedule, state format, offload and NVMe, LoRA/QLoRA,
checkpointing, compile); the ones only `bigfit train`'s loop reads (its data, evaluation, run
directory) are refused in one line, as is every mistake, before any work. The model is a Hugging
Face model object (a PreTrainedModel, or a peft model) or a path / hub name, which every rank then
builds on the meta device and fills with its own part, as `bigfit train` does. The job is resolved
by job/resolution.py, the plan applied by parallel/apply.py and the optimizer attached by
engine/build_optimizer: the same code, in the same order, as the loop's (anchors:
`deepspeed.initialize`, `accelerator.prepare`).
"""
from __future__ import annotations

import dataclasses
import tempfile

import torch

from ..adapters.lora import LoraSettings, check_targets, inject
from ..commands.decide import auto_strategy
from ..common.distributed import init_runtime, world_size
from ..common.precision import LossScaler
from ..engine import build_optimizer
from ..errors import BigfitError
from ..job.autoplan import prediction
from ..job.checks import validate
from ..job.resolution import Job, resolve
from ..layout.mesh import with_mesh
from ..layout.plan import plan_for
from ..loading import loads_per_rank
from ..models.source import build_model, load_config, locate
from ..parallel.apply import apply
from ..settings.config import TrainConfig
from ..settings.reading import check_keys
from .engine import UserEngine
from .wrapped import check_unwrapped

# Settings that only bigfit train's own loop reads: its data, its evaluation, its run directory and
# its processes. In the user's loop the user owns all of them.
LOOP_ONLY = ("data", "data_encoding", "data_columns", "data_split", "data_config", "chat_template", "data_cache",
             "dataset_num_proc", "output_dir", "overwrite", "report_to", "nproc", "save_every", "keep_checkpoints",
             "eval_every", "eval_on_start", "eval_samples", "max_train_samples", "num_beams", "max_new_tokens",
             "resume", "allow_changed", "consolidate", "pack", "checkpoints", "probe_only")
# settings that make the lr bigfit's schedule (training/step.py lr_at); without them it stays as set
SCHEDULE = ("max_steps", "warmup_steps", "lr_schedule", "min_lr", "warmup_min_lr", "warmup_type")
# the engines that build their optimizer over parameters they replace or keep elsewhere
OWN_OPTIMIZER = ("fsdp", "offload", "zero1")


def prepare(model, /, *, tokenizer=None, optimizer: torch.optim.Optimizer | None = None, loss_fn=None,
            sample: dict | None = None, **settings) -> UserEngine:
    """The engine for `model` under `settings` (bigfit train's names: strategy="zero2", precision="bf16",
    lr=1e-4, batch_size=..., micro_batch_size=... for gradient accumulation, max_steps for the lr
    schedule). `sample`: a batch like the loop's (input_ids, labels), which strategy="auto" rates;
    `optimizer`: the user's torch optimizer over model.parameters(), for the strategies that keep the
    parameters as they are (single, ddp); `tokenizer`: saved with each checkpoint; `loss_fn`: the
    pipeline schedules' loss (they run it inside their schedule). Every rank of the job calls it."""
    if isinstance(optimizer, str):  # the settings schema's optimizer="adamw" | "adam"
        settings, optimizer = {**settings, "optimizer": optimizer}, None
    cfg = _settings(model, settings, sample)
    check_unwrapped(model)
    world = world_size()  # the job's processes: torchrun, accelerate launch, srun, or this one alone
    job = resolve(_decided(cfg, model, world, sample), world)
    _check_fit(job, optimizer, loss_fn)
    rt = init_runtime(cfg.timeout_s, group_for_one=job.plan.engine == "fsdp", host_collectives=job.plan.offload_params)
    rt = with_mesh(rt, job.plan)
    module = _model(model, job.cfg, rt)
    engine = apply(module, job.plan, job.cfg, rt, _lengths(sample))
    engine.set_loss(loss_fn)
    if optimizer is not None:
        engine.optimizer = optimizer
    else:
        build_optimizer(engine, job.cfg)
    scaler = LossScaler.from_config(job.cfg) if job.cfg.precision == "fp16" else None
    scheduled = any(k.replace("-", "_") in SCHEDULE for k in settings)
    # the planner's row for engine.plan, rated once (rank 0 of the job; a large model's trace takes seconds)
    job = _predicted(job, model, sample) if rt.is_main else job
    return UserEngine(engine, job, rt, scaler=scaler, tokenizer=tokenizer, scheduled=scheduled,
                      sets_lr=optimizer is None)


def _settings(model, settings: dict, sample: dict | None) -> TrainConfig:
    """The settings checked by the schema and `validate`, one line for a mistake, before any work."""
    check_keys(settings, "bigfit.prepare()")
    settings = {k.replace("-", "_"): v for k, v in settings.items()}
    if loop := [k for k in settings if k in LOOP_ONLY]:
        raise BigfitError(f"bigfit.prepare(): {loop[0]}= is bigfit train's (its own loop reads it); in your loop "
                          "you feed the batches, evaluate and save (engine.save): drop it")
    if (settings.get("cp") or 1) > 1:  # the user's loss reads whole logits, which no rank has
        raise BigfitError(f"bigfit.prepare(): cp={settings['cp']} splits each sequence over ranks, whose loss bigfit "
                          "computes itself; in your own loop drop cp (bigfit train takes --cp)")
    if not isinstance(model, (str, torch.nn.Module)):
        raise BigfitError(f"bigfit.prepare(): model must be a torch.nn.Module (a Hugging Face model) or a model "
                          f"directory or hub name, not {type(model).__name__}")
    if sample is not None and not (isinstance(sample, dict) and torch.is_tensor(sample.get("input_ids"))):
        raise BigfitError("bigfit.prepare(): sample= is one batch as your loop feeds it: a dict with an "
                          "input_ids tensor (and labels), not " + type(sample).__name__)
    if settings.get("strategy") == "auto" and sample is None:
        raise BigfitError('bigfit.prepare(strategy="auto") rates a batch: pass sample= one batch of your loop '
                          "(a dict of input_ids and labels tensors)")
    cfg = TrainConfig(**{"batch_size": 0, **settings, "model": model if isinstance(model, str) else None})
    validate(dataclasses.replace(cfg, batch_size=cfg.batch_size or 1))
    return cfg


def _decided(cfg: TrainConfig, model, world: int, sample: dict | None) -> TrainConfig:
    """The batch split (gradient accumulation) and strategy auto's pick, as bigfit train takes them."""
    if cfg.strategy == "auto":
        rows = int(sample["input_ids"].shape[0])
        with _planned_model(model) as path:  # the planner reads the model's config from a directory
            picked = auto_strategy(dataclasses.replace(cfg, model=path, batch_size=cfg.batch_size or rows * world,
                                                       micro_batch_size=cfg.micro_batch_size or rows),
                                   _lengths(sample), processes=world, one_process=world == 1)
        cfg = dataclasses.replace(picked, model=cfg.model, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size)
    if not cfg.batch_size:  # no accumulation unless asked: one micro-batch a step on each data-parallel rank
        dp = plan_for(cfg.strategy, world, tp=cfg.tp, pp=cfg.pp, dp_shard=cfg.dp_shard, dp_replicate=cfg.dp_replicate).dp
        micro = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else 1
        cfg = dataclasses.replace(cfg, batch_size=dp * micro, micro_batch_size=micro)
    return cfg


def _check_fit(job: Job, optimizer, loss_fn) -> None:
    plan = job.plan
    if optimizer is not None and (plan.engine in OWN_OPTIMIZER or plan.tp > 1 or plan.pp > 1):
        raise BigfitError(f"bigfit.prepare(): strategy {plan.name} builds its own optimizer over the parameters it "
                          "shards or keeps in host RAM: pass the optimizer's settings by name (optimizer='adamw', "
                          "lr=..., weight_decay=...), or strategy='single' / 'ddp', which take optimizer=")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise BigfitError(f"bigfit.prepare(): optimizer= must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if plan.pp > 1 and loss_fn is None:
        raise BigfitError(f"bigfit.prepare(): strategy {plan.name} runs pipeline stages, whose schedule computes the "
                          "loss inside it: pass loss_fn=(logits, labels) -> loss and call engine.forward_backward(batch)")
    if loss_fn is not None and not callable(loss_fn):
        raise BigfitError(f"bigfit.prepare(): loss_fn must be a function (logits, labels) -> loss, not "
                          f"{type(loss_fn).__name__}")


def _model(model, cfg: TrainConfig, rt) -> torch.nn.Module:
    """A model object as given; a path or hub name built as bigfit train builds it (the meta device on
    every rank that fills its own part), with its LoRA adapters."""
    if isinstance(model, torch.nn.Module):
        out = model
    else:
        source = locate(cfg.model)
        out = build_model(source, load_config(source), cfg.seed, on_meta=not rt.is_main or loads_per_rank(source))
    if lora := LoraSettings.from_config(cfg):
        check_targets(out, lora)
        inject(out, lora)
    return out


def _lengths(sample: dict | None) -> tuple[int, int] | None:
    """A sample batch's source and target tokens, as the planner rates the data's longest sample."""
    if sample is None:
        return None
    source = int(sample["input_ids"].shape[-1])
    labels = sample.get("labels")
    return source, int(labels.shape[-1]) if torch.is_tensor(labels) else source


class _planned_model:
    """A directory holding the model's config, for the planner (it rates configs, not objects)."""

    def __init__(self, model):
        self.model, self.tmp = model, None

    def __enter__(self) -> str:
        if isinstance(self.model, str):
            return self.model
        self.tmp = tempfile.TemporaryDirectory(prefix="bigfit-plan-")
        self.model.config.save_pretrained(self.tmp.name)
        return self.tmp.name

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()


def _predicted(job: Job, model, sample: dict | None) -> Job:
    """The job with the planner's row for it (engine.plan shows it); a model it cannot rate is a note."""
    try:
        with _planned_model(model) as path:
            text = prediction(dataclasses.replace(job.cfg, model=path), job.batching.world_size, _lengths(sample))
    except Exception as e:  # noqa: BLE001  the loop goes on without it
        text = f"none: the planner could not rate this job ({type(e).__name__}: {e})"
    return dataclasses.replace(job, prediction=text or "none: the planner rates no row for this layout")

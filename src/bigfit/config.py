"""The training job's configuration: one typed dataclass, defaults -> file -> command line.

Every "auto" / None default is resolved in one place, `resolve`, once the world size is known, so
the rest of the code only ever sees concrete numbers.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import BigfitError, one_of

STRATEGIES = ("single", "ddp", "zero3")
PRECISIONS = ("fp32", "bf16")


@dataclass
class TrainConfig:
    """What to train, on what, and how. Field comments are the `--help` texts."""

    model: str | None = None  # hub name, local dir with weights, or dir with only config.json; None: embedded tiny T5
    data: str | None = None  # JSONL (source/target or text), CSV (source,target) or .txt; None: embedded task
    output_dir: str = "bigfit-out"  # checkpoints, metrics.jsonl, consolidated model
    max_steps: int = 600  # optimizer steps
    batch_size: int = 32  # GLOBAL batch: samples per optimizer step, over all processes and micro-batches
    micro_batch_size: int | None = None  # samples per forward/backward on one process; None: batch_size / nproc
    seed: int = 0  # weights, data order and dropout
    nproc: int | None = None  # local worker processes; None: one per GPU, or 2 on a CPU-only machine
    strategy: str = "zero3"  # one of STRATEGIES
    precision: str = "fp32"  # one of PRECISIONS
    lr: float = 1e-3  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    warmup_steps: int = 20  # linear warm-up, then linear decay to 0 at max_steps
    max_grad_norm: float = 1.0  # clip the global gradient norm; 0 disables
    max_source_len: int = 128  # tokens kept per source / text sample
    max_target_len: int = 128  # tokens kept per target (encoder-decoder models)
    save_every: int = 200  # save a checkpoint every N steps (and always at the end); 0: only at the end
    eval_every: int = 200  # evaluate every N steps (and at step 0 and at the end); 0: only at the end
    eval_samples: int = 64  # held-out samples used for evaluation
    num_beams: int = 4  # beam width for generate() during evaluation
    max_new_tokens: int = 32  # generation length limit during evaluation
    resume: str | None = None  # "latest" (newest complete checkpoint in output_dir) or a checkpoint dir
    timeout_s: float = 300.0  # collective timeout: a stuck peer fails the job instead of hanging it
    consolidate: bool = True  # write output_dir/model (Hugging Face format) at the end
    extra: dict = field(default_factory=dict)  # resolved values (grad accumulation), filled by resolve

    @staticmethod
    def field_names() -> list[str]:
        return [f.name for f in dataclasses.fields(TrainConfig) if f.name != "extra"]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_config_file(path: str) -> dict:
    """Read a YAML or JSON file of TrainConfig fields; unknown keys are an error naming them."""
    p = Path(path)
    if not p.is_file():
        raise BigfitError(f"config file {path!r} does not exist")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = json.loads(text)
    except Exception as e:  # both parsers say where the syntax broke
        raise BigfitError(f"config file {path!r} is not valid {p.suffix[1:] or 'JSON'}: {e}") from None
    if not isinstance(values, dict):
        raise BigfitError(f"config file {path!r} must hold a mapping of settings, not {type(values).__name__}")
    check_keys(values, f"config file {path!r}")
    return {k.replace("-", "_"): v for k, v in values.items()}


def check_keys(values: dict, where: str) -> None:
    valid = TrainConfig.field_names()
    bad = [k for k in values if k.replace("-", "_") not in valid]
    if bad:
        raise BigfitError(f"unknown setting(s) {', '.join(map(repr, bad))} in {where}; valid: {', '.join(valid)}")


def validate(cfg: TrainConfig) -> None:
    """Checks that need no model, data or processes. Raises BigfitError naming the bad value."""
    if cfg.strategy not in STRATEGIES:
        raise one_of("strategy", cfg.strategy, STRATEGIES)
    if cfg.precision not in PRECISIONS:
        raise one_of("precision", cfg.precision, PRECISIONS)
    for name in ("max_steps", "batch_size", "max_source_len", "max_target_len", "num_beams", "max_new_tokens"):
        if getattr(cfg, name) <= 0:
            raise BigfitError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)}")
    for name in ("save_every", "eval_every", "warmup_steps", "eval_samples"):
        if getattr(cfg, name) < 0:
            raise BigfitError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(cfg, name)}")
    if cfg.nproc is not None and cfg.nproc < 1:
        raise BigfitError(f"--nproc must be at least 1, got {cfg.nproc}")
    if cfg.micro_batch_size is not None and cfg.micro_batch_size < 1:
        raise BigfitError(f"--micro-batch-size must be at least 1, got {cfg.micro_batch_size}")
    if cfg.lr <= 0 or cfg.timeout_s <= 0:
        raise BigfitError(f"--lr and --timeout-s must be positive, got {cfg.lr} and {cfg.timeout_s}")
    if cfg.strategy == "single" and (cfg.nproc or 1) > 1:
        raise BigfitError(f"strategy 'single' runs one process, but --nproc is {cfg.nproc}; use ddp or zero3")


def resolve(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """Fill every derived value for `world_size` processes. The global batch never changes here:
    only how it is split into processes x gradient-accumulation steps x micro-batches."""
    validate(cfg)
    if cfg.batch_size % world_size:
        raise BigfitError(
            f"--batch-size {cfg.batch_size} is not divisible by the {world_size} processes; "
            f"use a multiple of {world_size}")
    per_rank = cfg.batch_size // world_size
    micro = cfg.micro_batch_size or per_rank
    if per_rank % micro:
        raise BigfitError(
            f"--micro-batch-size {micro} does not divide the per-process batch {per_rank} "
            f"(--batch-size {cfg.batch_size} / {world_size} processes); valid: "
            + ", ".join(str(d) for d in range(1, per_rank + 1) if per_rank % d == 0))
    out = dataclasses.replace(cfg, micro_batch_size=micro, extra=dict(cfg.extra))
    out.extra.update(world_size=world_size, per_rank_batch=per_rank, grad_accum=per_rank // micro)
    return out

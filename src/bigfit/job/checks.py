"""`validate`: the checks of a TrainConfig that need no model, data or processes, each raising a
BigfitError that names the bad value and what would be valid (settings/config.py holds the settings)."""
from __future__ import annotations

from ..adapters.lora import LoraSettings
from ..data.columns import Columns
from ..data.files import KINDS
from ..data.tables import is_table
from ..errors import BigfitError, one_of
from ..settings.config import (ACTIVATIONS, OPTIMIZER_STATES, OPTIMIZERS, PIPELINE_SCHEDULES, PIPELINE_STRATEGIES, PRECISIONS,
                               REDUCE_DTYPES, RANGES, REPORTERS, SCHEDULES, SPLIT_STRATEGIES, STRATEGIES, WARMUPS,
                               TrainConfig)
from ..settings.planflags import LORA_FLAGS
from ..settings.reading import holds, setting_names, type_problem
from ..settings.userfiles import check_encoding, user_file


def validate(cfg: TrainConfig) -> None:
    """Checks that need no model, data or processes. Raises BigfitError naming the bad value."""
    _validate_types(cfg)
    check_encoding(cfg.data_encoding)
    Columns.parse(cfg.data_columns)  # its one line before any data is read
    if cfg.data is not None and not is_table(cfg.data):  # a file: a mistyped path said before torch loads (5 s)
        user_file(cfg.data, f"--data {cfg.data!r}", KINDS)
    reporters(cfg.report_to)
    strategies = (*STRATEGIES, *SPLIT_STRATEGIES, *PIPELINE_STRATEGIES, "auto")
    for name, valid in (("strategy", strategies), ("optimizer", OPTIMIZERS), ("lr_schedule", SCHEDULES),
                        ("warmup_type", WARMUPS), ("reduce_dtype", REDUCE_DTYPES)):
        if getattr(cfg, name) not in valid:
            raise one_of(name.replace("_", "-"), getattr(cfg, name), valid)
    if cfg.precision is not None and cfg.precision not in PRECISIONS:
        raise one_of("precision", cfg.precision, (*PRECISIONS, "auto"))
    _validate_ranges(cfg)
    if cfg.max_train_samples is not None and cfg.batch_size != "auto" and cfg.max_train_samples < cfg.batch_size:
        raise BigfitError(f"--max-train-samples must be at least the global batch ({cfg.batch_size}), got "
                          f"{cfg.max_train_samples}")
    if cfg.delayed_update and not cfg.strategy.startswith("zero2-offload"):
        raise BigfitError(f"--delayed-update needs --strategy zero2-offload (its host optimizer step is what is "
                          f"delayed), not {cfg.strategy}")
    _validate_offload(cfg)
    _validate_activations(cfg)
    _validate_compile(cfg)
    _validate_lora(cfg)
    if cfg.strategy != "device_map" and cfg.device_map is not None:
        raise BigfitError(f"--device-map belongs to --strategy device_map, not {cfg.strategy}")
    _validate_pipeline(cfg)


def _validate_lora(cfg: TrainConfig) -> None:
    if cfg.load_in_4bit:  # torch only then: every bigfit command validates, and torch takes a second to import
        import torch

        from ..adapters.quantize import check as check_4bit

        check_4bit(cfg, torch.cuda.is_available())
    given = {f: getattr(cfg, f) for f in LORA_FLAGS if getattr(cfg, f) != getattr(TrainConfig, f)}
    if LoraSettings.checked(cfg.lora, given, "train") and cfg.sequence_parallel:  # adapters see whole sequences
        raise BigfitError("--lora with --sequence-parallel: adapters on a residual stream split by sequence are not "
                          "supported; drop --sequence-parallel (--tp alone splits the adapters with their layers)")


def _validate_types(cfg: TrainConfig) -> None:
    """Each field holds its annotated type. Files and flags are converted before a TrainConfig is built
    (settings.setting_value); this catches one built in Python, such as TrainConfig(max_steps="10")."""
    for name in setting_names():
        if not holds(name, getattr(cfg, name)):
            raise BigfitError(f"setting {name} {type_problem(name, getattr(cfg, name), in_file=False)}")


def _validate_ranges(cfg: TrainConfig) -> None:
    """Each number within its setting's range (config.RANGES); "auto" and None are the types' to check."""
    for name, valid in RANGES.items():
        value = getattr(cfg, name)
        if isinstance(value, (int, float)) and not valid.holds(value):
            raise BigfitError(f"--{name.replace('_', '-')} must be {valid.describe()}, got {value}")


def _validate_activations(cfg: TrainConfig) -> None:
    if cfg.activations not in ACTIVATIONS:
        raise one_of("--activations", cfg.activations, ACTIVATIONS)
    if cfg.activation_checkpointing and cfg.activations == "keep":
        raise BigfitError("--activation-checkpointing recomputes activations, --activations keep stores them: give one "
                          "(--activations checkpoint is --activation-checkpointing)")
    if cfg.checkpoint_blocks is not None and cfg.activations == "keep":
        raise BigfitError(f"--checkpoint-blocks {cfg.checkpoint_blocks} says how many blocks are checkpointed: it "
                          "belongs to --activations checkpoint, offload or auto, not keep")


def _validate_offload(cfg: TrainConfig) -> None:
    if cfg.offload_grads not in ("host", "device"):
        raise one_of("--offload-grads", cfg.offload_grads, ("host", "device"))
    if cfg.offload_grads != "host" and not cfg.strategy.startswith("zero2-offload"):
        raise BigfitError(f"--offload-grads belongs to --strategy zero2-offload(-nvme), not {cfg.strategy}")
    if cfg.nvme_host_gb is not None and cfg.strategy != "zero2-offload-nvme":
        raise BigfitError(f"--nvme-host-gb must be 0 or more and belongs to --strategy zero2-offload-nvme; got "
                          f"{cfg.nvme_host_gb} with {cfg.strategy}")
    if cfg.optimizer_states not in (*OPTIMIZER_STATES, "auto"):
        raise one_of("--optimizer-states", cfg.optimizer_states, (*OPTIMIZER_STATES, "auto"))
    if cfg.optimizer_states not in ("fp32", "auto") and not cfg.strategy.startswith(("zero2-offload", "auto")):
        raise BigfitError(f"--optimizer-states {cfg.optimizer_states} belongs to --strategy zero2-offload(-nvme), "
                          f"whose host step keeps the moments in it; {cfg.strategy} keeps fp32 states")


def _validate_compile(cfg: TrainConfig) -> None:
    if cfg.compile_backend != "inductor" and not cfg.compile:
        raise BigfitError(f"--compile-backend {cfg.compile_backend} belongs to --compile, which is off")
    if cfg.compile:
        import torch._dynamo  # only here: seconds of imports that a job without --compile need not pay

        backends = torch._dynamo.list_backends(exclude_tags=())
        if cfg.compile_backend not in backends:
            raise one_of("--compile-backend", cfg.compile_backend, backends)


def _pipelined(cfg: TrainConfig) -> bool:
    return cfg.strategy == "pipeline" or (cfg.pp or 1) > 1


def _validate_pipeline(cfg: TrainConfig) -> None:
    """The pipeline's own values; which layouts take a pipeline's flags, and how many processes a
    pipeline needs, are the plan's rules (layout/plan.py), checked once where the job is resolved."""
    if cfg.pipeline_schedule is not None and cfg.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise one_of("--pipeline-schedule", cfg.pipeline_schedule, PIPELINE_SCHEDULES)
    if not _pipelined(cfg):
        return
    if "auto" in (cfg.batch_size, cfg.micro_batch_size):
        raise BigfitError("a pipeline does not size its batches by probing yet (the probe runs data-parallel "
                          "shares): give --batch-size and --micro-batch-size as numbers")


def reporters(spec: str) -> tuple[str, ...]:
    """The dashboards --report-to names (training/trackers.py), each installed, or one line saying why not."""
    import importlib.util

    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip() and n.strip() != "none"))
    if bad := [n for n in names if n not in REPORTERS]:
        raise BigfitError(f"--report-to {spec!r}: {', '.join(map(repr, bad))} is no reporter; give a comma-separated "
                          f"list of {', '.join(REPORTERS)}, or none")
    if missing := [n for n in names if importlib.util.find_spec(n) is None]:
        raise BigfitError(f"--report-to {spec!r}: {', '.join(missing)} is not installed; pip install 'bigfit[tracking]' "
                          f"(or pip install {' '.join(missing)})")
    return names

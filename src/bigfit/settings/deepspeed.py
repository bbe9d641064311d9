"""Read a DeepSpeed JSON config, as DeepSpeed users write it, and say what it means in bigfit.

`map_deepspeed` turns the config into `TrainConfig` field values (ZeRO stage + offload -> strategy,
fp16/bf16 -> precision and loss scaling, optimizer, scheduler, batch sizes) and sorts every other key
into `automatic` (FSDP2 or bigfit does that job by itself) or `ignored` (no bigfit meaning). The string
"auto" (Hugging Face Trainer style) means "not set here": that setting is left to bigfit's default or
the command line. Contradictions DeepSpeed would reject are a `BigfitError` naming the keys.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..errors import BigfitError, one_of
from .config import REDUCE_DTYPES, WARMUPS, TrainConfig
from .reading import field_type
from .userfiles import read_text

Z = "zero_optimization."
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Numbers copied straight into a TrainConfig field: DeepSpeed key -> field (an integer where the field is an int).
NUMBERS = {"fp16.loss_scale": "loss_scale", "fp16.initial_scale_power": "initial_scale_power",
           "fp16.loss_scale_window": "loss_scale_window", "fp16.hysteresis": "hysteresis",
           "fp16.min_loss_scale": "min_loss_scale", "optimizer.params.lr": "lr", "optimizer.params.eps": "adam_eps",
           "optimizer.params.weight_decay": "weight_decay", "scheduler.params.warmup_min_lr": "warmup_min_lr",
           "scheduler.params.warmup_num_steps": "warmup_steps", "scheduler.params.total_num_steps": "max_steps",
           "gradient_clipping": "max_grad_norm"}
# Keys the map_* functions below read themselves.
RULES = {Z + "stage", Z + "offload_optimizer.device", Z + "offload_optimizer.nvme_path", Z + "offload_param.device", Z + "cpu_offload",
         Z + "cpu_offload_params", Z + "reduce_bucket_size", "fp16.enabled", "bf16.enabled", "bfloat16.enabled",
         "optimizer.type", "optimizer.params.betas", "optimizer.params.adam_w_mode", "scheduler.type",
         "scheduler.params.warmup_type", "scheduler.params.warmup_max_lr", "communication_data_type", *BATCH_KEYS}
# Bucketing, prefetching, persistence and pinned buffers: FSDP2 and bigfit decide these by themselves.
AUTOMATIC = {Z + k for k in """allgather_bucket_size allgather_partitions reduce_scatter overlap_comm
             contiguous_gradients round_robin_gradients sub_group_size cpu_offload_use_pin_memory
             stage3_prefetch_bucket_size stage3_param_persistence_threshold stage3_max_live_parameters
             stage3_max_reuse_distance stage3_gather_16bit_weights_on_model_save
             stage3_gather_fp16_weights_on_model_save""".split()} | {
    f"{Z}{part}.{k}" for part in ("offload_optimizer", "offload_param")
    for k in ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "fast_init")}
SECTIONS = {"zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "scheduler"}
# Scheduler type, lower case -> (DeepSpeed's spelling, bigfit lr_schedule, the params it reads)
WARMUP = {"warmup_num_steps", "warmup_type"}
SCHEDULERS = {"warmuplr": ("WarmupLR", "constant", WARMUP | {"warmup_min_lr", "warmup_max_lr"}),
              "warmupdecaylr": ("WarmupDecayLR", "linear",
                                WARMUP | {"warmup_min_lr", "warmup_max_lr", "total_num_steps"}),
              "warmupcosinelr": ("WarmupCosineLR", "cosine", WARMUP | {"total_num_steps"})}


@dataclass
class DeepSpeedMapping:
    values: dict  # TrainConfig field name -> value, only for settings the DeepSpeed config really sets
    strategy: str  # bigfit strategy; "auto" when zero_optimization.stage is "auto" (bigfit decides)
    summary: str  # one line for the user
    ignored: list[str]  # dotted keys with no bigfit meaning
    automatic: list[str]  # dotted keys whose job FSDP2 / bigfit does by itself


@dataclass
class _Walk:
    """What has been learned so far while reading the config."""
    values: dict = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    automatic: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def choice(self, path: str, v, valid, name: str) -> None:
        if is_set(v) and v not in valid:
            raise one_of(path, v, valid)
        if is_set(v):
            self.values[name] = v


def is_set(v) -> bool:
    return v is not None and v != "auto"


def number(path: str, v, integer: bool = False, minimum: float | None = None):
    """`v` checked as a number (an integer: 2.0 is 2, 2.5 is an error); JSON's NaN and Infinity are none."""
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v))
            or (integer and v != int(v))):
        raise BigfitError(f"{path} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if minimum is not None and v < minimum:
        raise BigfitError(f"{path} must be at least {minimum}, got {v}")
    return int(v) if integer else v


def section(parent: dict, key: str, path: str) -> dict:
    """The JSON object at `key`; {} when absent or "auto"."""
    v = parent.get(key)
    if is_set(v) and not isinstance(v, dict):
        raise BigfitError(f"{path} must be a JSON object, got {v!r}")
    return v if is_set(v) else {}


def map_zero(w: _Walk, z: dict) -> str:
    """ZeRO stage and offload -> strategy; DeepSpeed without zero_optimization runs stage 0 (DDP)."""
    stage = z.get("stage", 0)
    if stage != "auto" and (type(stage) is not int or stage not in (0, 1, 2, 3)):  # not true, not 2.0
        raise one_of(Z + "stage", stage, (0, 1, 2, 3))
    bucket = z.get("reduce_bucket_size")
    if is_set(bucket) and stage in (2, 3):  # FSDP2 reduce-scatters each block's gradients as one bucket
        w.automatic.append(Z + "reduce_bucket_size")
    elif is_set(bucket):  # stages 0 and 1 reduce gradients with DDP, whose bucket this is
        w.values["ddp_bucket_mb"] = number(Z + "reduce_bucket_size", bucket) / 2**20
    strategy = zero_strategy(w, z, stage, offload(z, "offload_optimizer", "cpu_offload"),
                             offload(z, "offload_param", "cpu_offload_params"))
    if strategy != "auto":
        w.values["strategy"] = strategy
    return strategy


def offload(z: dict, key: str, old_key: str) -> str | None:
    """The key that asks for CPU offload, or None. The older boolean `old_key` means device "cpu"."""
    device, path = section(z, key, Z + key).get("device"), f"{Z}{key}.device"
    if not is_set(device):
        device, path = ("cpu" if z.get(old_key) is True else "none"), Z + old_key
    if device == "nvme" and key == "offload_param":
        raise BigfitError(f"{path} 'nvme': bigfit offloads parameters to host RAM only (zero3-offload); "
                          "use 'cpu', or offload_optimizer 'nvme' with stage 2")
    if device not in ("cpu", "none", "nvme"):
        raise one_of(path, device, ("cpu", "none", "nvme"))
    return None if device == "none" else path.removesuffix(".device") + (":nvme" if device == "nvme" else "")


def zero_strategy(w: _Walk, z: dict, stage, opt: str | None, par: str | None) -> str:
    if stage == "auto":
        opt = opt.removesuffix(":nvme") if opt else opt
        if opt or par:
            raise BigfitError(f"{opt or par} needs a {Z}stage (1, 2 or 3), not 'auto'")
        return "auto"
    if opt and opt.endswith(":nvme"):  # the optimizer's NVMe tier is zero2-offload-nvme
        opt = opt.removesuffix(":nvme")
        if stage == 3 or par:
            raise BigfitError(f"{opt} 'nvme' with {Z}stage 3: bigfit's NVMe tier is zero2-offload-nvme; use "
                              f"{Z}stage 2 (or 'cpu' with stage 3)")
        if stage == 0:
            raise BigfitError(f"{opt} needs {Z}stage 1 or 2 for 'nvme', not {Z}stage 0")
        nvme = z.get("offload_optimizer", {}).get("nvme_path") if isinstance(z.get("offload_optimizer"), dict) else None
        if is_set(nvme) and not isinstance(nvme, str):
            raise BigfitError(f"{Z}offload_optimizer.nvme_path must be a directory path (a string), got {nvme!r}")
        if is_set(nvme):
            w.values["nvme_dir"] = nvme
        return "zero2-offload-nvme"
    if par and stage < 3:
        raise BigfitError(f"{par} needs {Z}stage 3 (only stage 3 offloads parameters), not {Z}stage {stage}")
    if opt and stage == 0:
        raise BigfitError(f"{opt} needs {Z}stage 1, 2 or 3 (stage 0 shards no optimizer state), not {Z}stage 0")
    if stage == 3 and (opt or par):
        if not (opt and par):  # bigfit's zero3-offload is one setting for both
            also = "parameters" if opt else "optimizer state"
            w.notes.append(f"bigfit's zero3-offload also keeps {also} in host RAM")
        return "zero3-offload"
    if opt and stage == 1:  # DeepSpeed itself runs stage 1 with offload through its stage-2 code
        w.notes.append("stage 1 with optimizer offload runs as zero2-offload, as in DeepSpeed")
    return "zero2-offload" if opt else ("ddp", "zero1", "zero2", "zero3")[stage]


def map_precision(w: _Walk, ds: dict) -> str | None:
    bf = "bfloat16" if "bfloat16" in ds and "bf16" not in ds else "bf16"  # bfloat16: DeepSpeed's older name
    # True, False or "auto"; None for an absent section. An "enabled" left out is false, as in DeepSpeed.
    f, b = (section(ds, k, k).get("enabled", False) if is_set(ds.get(k)) else ds.get(k) for k in ("fp16", bf))
    for key, e in (("fp16", f), (bf, b)):
        if e not in (None, "auto") and not isinstance(e, bool):
            raise BigfitError(f'{key}.enabled must be true, false or "auto", got {e!r}')
    if f is True and b is True:
        raise BigfitError(f"fp16.enabled and {bf}.enabled are both true; enable at most one of them")
    precision = "fp16" if f is True else "bf16" if b is True else None
    if precision is None and "auto" not in (f, b) and False in (f, b):
        precision = "fp32"
    if precision:
        w.values["precision"] = precision
    return precision  # the loss-scaling numbers are NUMBERS, read by sort_keys


def describe_precision(values: dict, precision: str | None) -> str:
    if precision != "fp16":
        return f"precision {precision or 'from bigfit'}"
    get = lambda k: values.get(k, getattr(TrainConfig, k))  # noqa: E731 (class attributes hold the defaults)
    if get("loss_scale"):
        return f"precision fp16 (static loss scale {get('loss_scale'):g})"
    return (f"precision fp16 (dynamic loss scale 2**{get('initial_scale_power')}, window {get('loss_scale_window')}, "
            f"hysteresis {get('hysteresis')}, min {get('min_loss_scale'):g})")


def map_optimizer(w: _Walk, opt: dict):
    """Adam / AdamW and their betas; returns optimizer.params.lr for the scheduler to compare with."""
    params, kind = section(opt, "params", "optimizer.params"), str(opt.get("type", "auto"))
    if kind != "auto" and kind.lower() not in ("adam", "adamw"):
        raise BigfitError(f"optimizer.type {kind!r} is not supported by bigfit; supported: Adam, AdamW")
    if kind != "auto":  # DeepSpeed's Adam decouples weight decay (AdamW) unless adam_w_mode is false
        w.values["optimizer"] = "adam" if kind.lower() == "adam" and params.get("adam_w_mode") is False else "adamw"
    betas = params.get("betas")
    if is_set(betas) and (not isinstance(betas, list) or len(betas) != 2):
        raise BigfitError(f"optimizer.params.betas must be a list of two numbers, got {betas!r}")
    for name, beta in zip(("adam_beta1", "adam_beta2"), betas if is_set(betas) else ()):
        if is_set(beta):
            w.values[name] = number("optimizer.params.betas", beta)
    return params.get("lr")


def map_scheduler(w: _Walk, sched: dict, optimizer_lr) -> set[str]:
    """WarmupLR, WarmupDecayLR, WarmupCosineLR -> schedule; returns the param keys that type does not read."""
    params, kind = section(sched, "params", "scheduler.params"), str(sched.get("type", "auto"))
    unread = {f"scheduler.params.{k}" for k in params}
    if kind == "auto":  # nothing to read the params by
        return unread
    if kind.lower() not in SCHEDULERS:
        raise BigfitError(f"scheduler.type {kind!r} is not supported by bigfit; supported: "
                          + ", ".join(s[0] for s in SCHEDULERS.values()))
    _, w.values["lr_schedule"], reads = SCHEDULERS[kind.lower()]
    if kind.lower() == "warmupdecaylr" and is_set(params.get("warmup_min_lr")):  # it decays back down to it
        w.values["min_lr"] = number("scheduler.params.warmup_min_lr", params["warmup_min_lr"])
    # DeepSpeed's default warm-up curve is log
    w.choice("scheduler.params.warmup_type", params.get("warmup_type", "log"), WARMUPS, "warmup_type")
    max_lr = params.get("warmup_max_lr")
    if "warmup_max_lr" in reads and is_set(max_lr):  # the scheduler drives the lr itself, as in DeepSpeed
        lr = w.values["lr"] = number("scheduler.params.warmup_max_lr", max_lr)
        if is_set(optimizer_lr) and number("optimizer.params.lr", optimizer_lr) != lr:
            w.notes.append(f"scheduler.params.warmup_max_lr {lr:g} overrides optimizer.params.lr "
                           f"{optimizer_lr:g}")
    return {p for p in unread if p.rsplit(".", 1)[1] not in reads}


def map_batch(w: _Walk, ds: dict, world: int) -> str:
    """DeepSpeed's rule: train_batch_size = micro-batch x accumulation x world size; derive the missing one."""
    b, m, a = (number(k, ds[k], True, minimum=1) if is_set(ds.get(k)) else None for k in BATCH_KEYS)
    if b and m and a and b != m * a * world:
        raise BigfitError(f"train_batch_size {b} must equal train_micro_batch_size_per_gpu {m} x "
                          f"gradient_accumulation_steps {a} x world_size {world} = {m * a * world}")
    if m and a:
        b = m * a * world
    elif b and (m or a):
        given, n, derived = (BATCH_KEYS[1], m, BATCH_KEYS[2]) if m else (BATCH_KEYS[2], a, BATCH_KEYS[1])
        if b % (n * world):
            raise BigfitError(f"train_batch_size {b} is not divisible by {given} {n} x world_size {world} "
                              f"= {n * world}, so {derived} cannot be derived")
        m, a = (m, b // (m * world)) if m else (b // (a * world), a)
    elif a:  # bigfit derives accumulation from the two batch sizes; alone it sets neither
        w.ignored.append("gradient_accumulation_steps")
    w.values.update({k: v for k, v in (("batch_size", b), ("micro_batch_size", m)) if v})
    if b and m:
        return f"micro-batch {m} x accumulation {a} x {world} processes = global batch {b}"
    if m:
        return f"micro-batch {m}, global batch from bigfit"
    return f"global batch {b}" if b else "batch sizes from bigfit"


def sort_keys(w: _Walk, node: dict, unread: set[str], path: str = "") -> None:
    """Every key no map_* function read: a plain number (NUMBERS), automatic, or ignored."""
    for k, v in node.items():
        p = path + k
        if v == "auto" or (p in RULES and p not in unread):
            continue  # "auto": not set here, so nothing to report
        if isinstance(v, dict) and (v or p in SECTIONS):
            sort_keys(w, v, unread, p + ".")  # leaves only: exactly the settings that had no effect
        elif p in AUTOMATIC:
            w.automatic.append(p)
        elif p in NUMBERS and p not in unread:
            name = NUMBERS[p]
            w.values.setdefault(name, number(p, v, field_type(name)[0] is int))  # a rule's value (warmup_max_lr) wins
        else:
            w.ignored.append(p)


def map_deepspeed(ds: dict, world_size: int, name: str = "DeepSpeed config") -> DeepSpeedMapping:
    """What `ds` (a parsed DeepSpeed config) means for bigfit when run on `world_size` processes."""
    if not isinstance(ds, dict):
        raise BigfitError(f"{name} must be a JSON object, not {type(ds).__name__}")
    w = _Walk()
    strategy = map_zero(w, section(ds, "zero_optimization", "zero_optimization"))
    precision = map_precision(w, ds)
    optimizer_lr = map_optimizer(w, section(ds, "optimizer", "optimizer"))
    unread = map_scheduler(w, section(ds, "scheduler", "scheduler"), optimizer_lr)
    batch = map_batch(w, ds, world_size)
    w.choice("communication_data_type", ds.get("communication_data_type"), REDUCE_DTYPES, "reduce_dtype")
    sort_keys(w, ds, unread)  # DeepSpeed's own activation_checkpointing section lands in `ignored` here
    shown = "from bigfit" if strategy == "auto" else strategy
    summary = f"{name} -> strategy {shown}, {describe_precision(w.values, precision)}, {batch}"
    summary = "; ".join([summary, *w.notes])
    return DeepSpeedMapping(values=w.values, strategy=strategy, summary=summary,
                            ignored=sorted(set(w.ignored)), automatic=sorted(set(w.automatic)))


def load_deepspeed_config(path: str, world_size: int) -> DeepSpeedMapping:
    """Read a DeepSpeed JSON file and map it; BigfitError if it is missing, unreadable, not UTF-8, empty,
    not JSON or not an object."""
    text = read_text(path, f"DeepSpeed config {path!r}", "a DeepSpeed JSON config")
    try:
        ds = json.loads(text)
    except ValueError as e:  # the parser says where the syntax broke
        raise BigfitError(f"DeepSpeed config {path!r} is not valid JSON: {e}") from None
    return map_deepspeed(ds, world_size, name=f"DeepSpeed config {path}")

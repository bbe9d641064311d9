"""`bigfit train --strategy device_map [--device-map MAP.json | auto] [--chunks N]`: one process drives
every device of the map. The map file holds a device map (layout/maps.py), or {"auto": {device: budget}};
`auto` alone balances over this machine: each GPU's memory less the planner's reserve, then 90% of
host RAM as the overflow. `check` runs before any process or weight (on a meta-device model), and
`apply_device_map` is the split step of parallel/apply.py."""
from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..adapters.lora import LoraSettings
from ..adapters.quantize import describe as describe_4bit, quantize_base
from ..common.precision import compute_dtype
from ..engine.protocol import Applied
from ..errors import BigfitError
from ..layout.maps import canonical_device, real_device, resolve_map
from ..loading import Weights, fill
from ..machine.hardware import Hardware, host_ram
from ..planning.automap import assign, costs, parse_budgets, plan_budgets
from ..planning.workload import Workload, planned_lengths
from ..settings.userfiles import read_text
from .casts import cast_once
from .hooks import find_stacks, module_devices, parallelize
from .pipeline import run_chunks, split_batch


@dataclass
class DeviceMapApplied(Applied):
    main: str = "cpu"  # where inputs, embeddings, the head and the loss live
    chunks: int = 1  # GPipe micro-batches per forward (run_batch runs them through pipeline.run_chunks)
    device_types: tuple[str, ...] = ("cpu",)

    def run_batch(self, batch: dict, seq2seq: bool, factor: float, sync: bool) -> torch.Tensor:
        """With --chunks, the summed loss over GPipe micro-batches run by pipeline.run_chunks (a summed
        token loss needs no reweighting across chunks), backpropagated in one call (the pipeline's
        backward order needs it). Under autocast each weight is cast once for all chunks (casts.py)."""
        if self.chunks == 1:
            return super().run_batch(batch, seq2seq, factor, sync)
        with cast_once(self.model, enabled=self.autocast is not None):  # each call enters autocast itself
            loss = sum(run_chunks(lambda part: self.loss_sum(part, seq2seq), split_batch(batch, self.chunks),
                                  self.main, ordered_backward=True))
        (loss * factor).backward()
        return loss.detach()

    def forward_context(self):
        """Autocast on every kind of device the map uses, so each block computes in the same dtype."""
        if self.autocast is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for dev_type in self.device_types:
            stack.enter_context(torch.autocast(dev_type, dtype=self.autocast))
        return stack


def read_spec(cfg) -> tuple[str, object]:
    """("map", user map) or ("auto", budgets or None for this machine) from --device-map."""
    if cfg.device_map in (None, "auto"):
        return "auto", None
    what = f"--device-map {cfg.device_map!r}"
    if not Path(cfg.device_map).expanduser().exists():
        raise BigfitError(f"{what} is not a file; give MAP.json or 'auto'")
    try:  # read_text: a directory, unreadable, not UTF-8 or empty is one line too
        spec = json.loads(read_text(cfg.device_map, what, "MAP.json or 'auto'"))
    except ValueError as e:
        raise BigfitError(f"{what} is not valid JSON: {e}") from None
    if isinstance(spec, dict) and set(spec) == {"auto"}:
        return "auto", spec["auto"]
    return "map", spec


def machine_budgets() -> dict[str, int]:
    """This machine as budgets, as `bigfit plan` counts one node (auto.plan_budgets)."""
    gpus = tuple(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    if not gpus:
        return {"cpu": int(host_ram() * 0.9)}
    return dict(plan_budgets(Hardware(gpu_bytes=gpus, cpu_ram=host_ram())))


def _job(cfg, lengths: tuple[int, int] | None):
    source, target = planned_lengths(cfg, lengths)  # balanced for the batches the data makes, as the planner rates them
    return Workload(batch_size=cfg.batch_size, seq_len=source, target_len=target,
               micro_batch=cfg.micro_batch_size, precision=cfg.precision or "fp32",
               checkpointing=cfg.activation_checkpointing, lora=LoraSettings.from_config(cfg),
               load_in_4bit=cfg.load_in_4bit)


def _resolve(model, cfg, main, lengths: tuple[int, int] | None = None) -> object:
    """The checked DeviceMap for `model` (real or meta) under cfg; nothing moves. `lengths`: the
    data's longest sample, which an auto map is balanced for (else the length limits)."""
    found = find_stacks(model)
    kind, spec = read_spec(cfg)
    if kind == "auto":
        budgets = parse_budgets(spec or machine_budgets())
        spec = assign([s for s, _ in found], costs(model, found, _job(cfg, lengths)), budgets, main)[0]
    names = {p for p, _ in model.named_modules(remove_duplicate=False)}
    dmap = resolve_map(spec, tuple(s for s, _ in found), None, names)
    if dmap.main_device != main and (not isinstance(spec, dict) or "main_device" not in spec):
        dmap = resolve_map(spec, tuple(s for s, _ in found), main, names)  # unnamed: this process's device
    if dmap.main_device != main:
        raise BigfitError(f"--device-map: main_device {dmap.main_device} must be this process's device {main}, "
                          "where bigfit train puts the batches and computes the loss")
    return dmap


def check(cfg, job_model_config, lengths: tuple[int, int] | None = None) -> str:
    """Every check of the map before any weight exists: returns its description."""
    from ..models.source import meta_model

    return _resolve(meta_model(job_model_config), cfg, _this_device(), lengths).describe()


def pin_auto_map(cfg, micro: int, where: Path, lengths: tuple[int, int] | None = None) -> str | None:
    """`--device-map auto` balanced once, for micro-batch `micro`, written to `where` (its path
    returned; None where the map is the user's). The balancer moves blocks to the host as the
    micro-batch grows, so micro-batch auto's probe and the job it confirms must both run this map:
    balanced again at each size, the probe would confirm sizes for one map and train with another."""
    from ..models.source import load_config, locate, meta_model

    if read_spec(cfg)[0] != "auto":
        return None
    model = meta_model(load_config(locate(cfg.model)))
    dmap = _resolve(model, dataclasses.replace(cfg, micro_batch_size=micro), _this_device(), lengths)
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text(json.dumps(dmap.to_json(), indent=1))
    return str(where)


def _this_device() -> str:
    return canonical_device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")


def apply_device_map(model: torch.nn.Module, cfg, rt, weights: Weights | None = None,
                     lengths: tuple[int, int] | None = None) -> DeviceMapApplied:
    """The split step. A meta-device model with `weights` gets each module's storage on its device
    and is filled there, one tensor at a time: no copy of the whole model is ever on the host. A
    4-bit base (QLoRA) is quantized first, each layer on its device, by that device's store."""
    main = canonical_device(rt.device)
    dmap = _resolve(model, cfg, main, lengths)
    notes = []
    if cfg.load_in_4bit:
        where = module_devices(model, dmap)
        stores = quantize_base(model, weights, lambda name: real_device(where[name.rsplit(".", 1)[0]]))
        notes.append(describe_4bit(stores))
    parallelize(model, dmap.to_json())
    if weights is not None:
        fill(model, weights, main)
    types = tuple(sorted({torch.device(d.split(":")[0] if d.startswith("cpu") else d).type for d in dmap.devices()}))
    note = f"device map: {dmap.describe()}" + (f"; {cfg.chunks} chunks (GPipe)" if cfg.chunks > 1 else "")
    return DeviceMapApplied(model=model, module=model, strategy="device_map", autocast=compute_dtype(cfg.precision),
                            notes=[note, *notes], main=main, chunks=cfg.chunks, device_types=types)

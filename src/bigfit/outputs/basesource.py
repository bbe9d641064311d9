"""The tensors `bigfit consolidate` reads: a checkpoint's, and where a `--lora` checkpoint does not
hold its frozen base (every LoRA run's: engine/protocol.py `saved_model`), that base made again as
each start of the run made it (trainer.json's "frozen" record, ckptdir.frozen_record):
- a config-only or the default model: bigfit's seeded init of the injected model (loading.Weights
  without files), the run's seed, on the run's kind of device, whose values the init depends on.
  The adapters are injected first because they are part of the init's units: each unit's
  generator draws the base weights and the adapters in module order;
- safetensors weights (a directory, a hub snapshot in the local cache): read a tensor at a time;
- `.bin` weights or a hub name not in the cache: from_pretrained whole, as the run's rank 0 did.
Every value is fp32, what the run built before any transform.
"""
from __future__ import annotations

import copy
import types
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..adapters.lora import LoraSettings, inject, is_adapter
from ..errors import BigfitError
from ..loading import Checkpoint, Weights, loads_per_rank
from ..loading.files import safetensors_dir, weights_fingerprint
from ..models.source import build_model, locate
from . import safeload
from .ckptdir import frozen_of

MERGE_WITH_PEFT = ("consolidate without --merge and merge the adapter with peft: "
                   "PeftModel.from_pretrained(base, ADAPTER).merge_and_unload()")


def tensor_meta(ckpt: Path) -> dict[str, TensorStorageMetadata]:
    """The model's tensors in the checkpoint (names without the "model." prefix): shapes and dtypes."""
    return {k[len("model."):]: v for k, v in safeload.metadata(ckpt).state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


class Held:
    """The model tensors of checkpoint `ckpt` by their names in the run, and with `base` those of
    the frozen base it does not hold."""

    def __init__(self, ckpt: Path, base: "RebuiltBase | None" = None):
        self.ckpt, self.meta, self.base = ckpt, tensor_meta(ckpt), base
        self.names = set(self.meta) | (set(base.shapes) if base else set())

    def nbytes(self, name: str) -> int:
        if name in self.meta:
            return self.meta[name].size.numel() * self.meta[name].properties.dtype.itemsize
        return self.base.shapes[name].numel() * 4

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """These tensors, whole: the checkpoint's from every rank's files, the rest from the base."""
        mine = [n for n in names if n in self.meta]
        tensors = {n: torch.empty(self.meta[n].size, dtype=self.meta[n].properties.dtype) for n in mine}
        if tensors:
            with warnings.catch_warnings():  # "no process group: loading in one process" is the point here
                warnings.simplefilter("ignore", UserWarning)
                safeload.load({f"model.{n}": t for n, t in tensors.items()}, self.ckpt, no_dist=True)
        rest = [n for n in names if n not in self.meta]
        return {**tensors, **(self.base.read(rest) if rest else {})}


class RebuiltBase:
    """The frozen base of a LoRA checkpoint, made again from the run's source (module docstring), or
    from `given` (`--base DIR`: the base's new place). `shapes`: the injected model's base tensors."""

    def __init__(self, trainer: dict, config, given: str | None = None):
        settings, record = trainer["config"], frozen_of(trainer)
        model = given or record["source"]
        src = _located(model, "--base" if given else "the run's --model")
        _same_files(trainer, src, "--base" if given else "the run's --model")
        skeleton = build_model(src, config, settings["seed"], on_meta=True)
        inject(skeleton, LoraSettings.from_config(types.SimpleNamespace(**settings)))
        self.shapes = {n: t.shape for n, t in skeleton.state_dict().items() if not is_adapter(n)}
        if loads_per_rank(src):
            directory = safetensors_dir(src)
            device = _init_device(record["init_device"], model, needed=directory is None)
            self._weights = Weights(copy.deepcopy(skeleton), settings["seed"], device,
                                    Checkpoint(directory) if directory else None)
        else:
            self._weights, self._whole = None, _whole(src, config, settings, self.shapes)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        if self._weights is None:
            return {n: self._whole[n] for n in names}
        # in the init's unit order: each unit (a block, the rest) made once per call
        return {n: self._weights.read(n, None, torch.float32, "cpu") for n in sorted(names, key=self._weights.order)}


def _located(model: str | None, what: str):
    try:
        return locate(model)
    except BigfitError:  # a path that is gone, or no model directory any more
        raise BigfitError(f"--merge makes the base again from {what} {model!r}, which is no model directory "
                          f"(config.json, weights) or hub name now; give the base's directory with --base DIR, or "
                          f"{MERGE_WITH_PEFT}") from None


def _same_files(trainer: dict, src, what: str) -> None:
    """The base's weight files are the ones the run trained over (runinfo.identity's fingerprint)."""
    saved = (trainer.get("identity") or {}).get("base_fingerprint")
    now = weights_fingerprint(src) if saved else None
    if saved and now != saved:
        raise BigfitError(f"--merge: the weight files of {what} {src.name!r} are not the ones this run trained over "
                          f"(fingerprint {saved[:12]} -> {(now or 'none')[:12]}); give those with --base DIR, or "
                          f"{MERGE_WITH_PEFT}")


def _init_device(kind: str, model: str | None, needed: bool) -> torch.device:
    """Where the seeded init runs: on the run's kind of device, whose generator draws other values
    than another's. `needed`: the base is the init's (no weights files); else the init makes only
    the adapters and buffers, which are not merged, and any device does."""
    if _has(kind):
        return torch.device(kind)
    if needed:
        raise BigfitError(f"--merge: the base of this run is bigfit's seeded init of --model {model or '(default)'!r}, "
                          f"made on {kind}, whose values differ elsewhere; run bigfit consolidate --merge where a "
                          f"{kind} device is, or {MERGE_WITH_PEFT}")
    return torch.device("cpu")


def _has(kind: str) -> bool:
    return kind == "cpu" or getattr(torch, kind).is_available()


def _whole(src, config, settings: dict, shapes: dict) -> dict[str, torch.Tensor]:
    """The base by from_pretrained (the rank-0 path), under the injected names; checked against the
    checkpoint's model: a base of another shape is one line."""
    model = build_model(src, config, settings["seed"])
    inject(model, LoraSettings.from_config(types.SimpleNamespace(**settings)))
    state = {n: t for n, t in model.state_dict().items() if n in shapes}
    if bad := next((n for n in shapes if n not in state or state[n].shape != shapes[n]), None):
        raise BigfitError(f"--merge: the base {src.name!r} does not fit this checkpoint's model: {bad!r} "
                          f"{list(state[bad].shape) if bad in state else 'is missing'}, the checkpoint's model "
                          f"has {list(shapes[bad])}")
    return state

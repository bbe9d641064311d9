"""Pretrained weights in safetensors files, read a slice at a time.

Why `safe_open(...).get_slice(key)[box]` and not torch.distributed.checkpoint's
HuggingFaceStorageReader (present in torch 2.11 and 2.13): the file is memory-mapped, so a box reads
only its own bytes, and one call serves every layout bigfit fills: DTensor shards (FSDP2, tensor
parallel), whole tensors (one process, DDP replicas, pipeline stages) and the offload engine's whole
parameters, which are no DTensors. DCP's reader needs the checkpoint's keys to be the model's exactly
and plans every load collectively; checkpoints saved without the model's `base_model_prefix` or
without tied copies (both the usual case on the hub) would need a renaming layer around it anyway.
`.bin` (pickle) checkpoints cannot be read by slice: they keep the rank-0 path (rank 0 loads the
whole model with from_pretrained and the other ranks receive their parts).
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import BigfitError
from ..models.source import ModelSource

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def safetensors_dir(src: ModelSource) -> Path | None:
    """The local directory holding the model's safetensors weights: a --model directory, or a hub
    name's snapshot in the local cache (never the network). None: no such files (.bin only, no
    weights, or a hub name not cached), so the model is not read per rank."""
    directory = _weights_dir(src)
    return directory if directory and ((directory / SINGLE).is_file() or (directory / INDEX).is_file()) else None


SAMPLE = 1 << 20  # bytes read at the start, middle and end of each weight file for its fingerprint


def weights_fingerprint(src: ModelSource) -> str | None:
    """A fingerprint of the model's weight files (.safetensors, .bin): their names, sizes and 1 MiB
    at the start, middle and end of each, hashed; None without any (a config-only model, a hub name
    not in the cache). 3 MiB a file, whatever the model's size, tells one checkpoint of an
    architecture from another: a LoRA run's base, which its checkpoints do not hold, must still be
    the one it trained on when it resumes (settings/resume.py)."""
    import hashlib

    directory = _weights_dir(src)
    files = sorted(f for f in directory.iterdir() if f.suffix in (".safetensors", ".bin")) if directory else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for at in sorted({0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)}):
                fh.seek(at)
                h.update(fh.read(SAMPLE))
    return h.hexdigest()


def check_files(src: ModelSource) -> None:
    """Every weight file the model loads from opens, before any process starts: a safetensors file's
    header (its JSON and every tensor's offsets against the file's size, which safe_open checks
    without reading a tensor), a .bin's pickle on the meta device (its tensors mapped, not read), and
    the index naming the shards. One line naming the file; without this, a .bin (which the rank-0
    path reads) fails inside the process that trains, as a traceback."""
    directory = _weights_dir(src)
    for path in weight_files(directory) if directory else []:
        if path.suffix == ".safetensors":
            with _opened(path):
                pass
        else:
            _check_bin(path)


def weight_files(directory: Path) -> list[Path]:
    """The files from_pretrained reads, as it chooses them: safetensors over .bin, an index's shards."""
    for single, index in ((SINGLE, INDEX), (BIN, BIN_INDEX)):
        if (directory / index).is_file():
            return [directory / name for name in sorted(set(_weight_map(directory / index).values()))]
        if (directory / single).is_file():
            return [directory / single]
    return []


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        if isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values()):
            return weight_map
    except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError (random bytes) is a ValueError
        raise BigfitError(f"{index} is not a weights index (JSON with a weight_map): {e}") from None
    raise BigfitError(f"{index} is not a weights index: its weight_map is no mapping of tensor names to files")


def _opened(path: Path):
    """safe_open, or one line naming the file: random bytes, a file cut short, a header whose offsets
    lie (safetensors' own errors name no file)."""
    if not path.is_file():
        raise BigfitError(f"{path} is missing (named by {path.parent / INDEX})")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as e:
        raise BigfitError(f"{path} is not a readable safetensors file ({e}); download or save it again") from None


def _check_bin(path: Path) -> None:
    if not path.is_file():
        raise BigfitError(f"{path} is missing (named by {path.parent / BIN_INDEX})")
    try:
        # weights_only: a pickle from a model directory runs no code; a zip (torch.save's format since
        # 1.6) is mapped, so only its pickle is read; an older file is read whole, as loading would
        torch.load(path, map_location="meta", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:  # the unpickler and the zip reader raise a dozen types for a corrupt file
        text = str(e)
        if "WeightsUnpickler error:" in text:  # torch's advice to unpickle it unsafely comes first: the reason follows
            text = text.split("WeightsUnpickler error:", 1)[1]
        reason = next((line.strip() for line in text.splitlines() if line.strip()), "").split(". ")[0]
        raise BigfitError(f"{path} is not a readable PyTorch checkpoint ({type(e).__name__}: {reason}); download or "
                          "save it again") from None


def _weights_dir(src: ModelSource) -> Path | None:
    if src.kind == "weights":
        directory = Path(src.name).expanduser()
    elif src.kind == "hub":
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            directory = Path(snapshot_download(src.name, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            return None
    else:
        return None
    return directory


class Checkpoint:
    """The tensors of one safetensors checkpoint (one file, or the shards an index names), each file
    opened once, memory-mapped. `bytes_read` counts the bytes of every box read (tests hold each
    rank to its share)."""

    def __init__(self, directory: Path):
        self.directory, self._handles = Path(directory), {}
        index = self.directory / INDEX
        if index.is_file():
            weight_map = _weight_map(index)
        else:
            weight_map = {key: SINGLE for key in self._open(self.directory / SINGLE).keys()}
        self.path_of = {key: self.directory / name for key, name in weight_map.items()}
        self.bytes_read = 0

    def _open(self, path: Path):
        if path not in self._handles:
            self._handles[path] = _opened(path)
        return self._handles[path]

    def keys(self) -> set[str]:
        return set(self.path_of)

    def where(self, key: str | None = None) -> str:
        """The file a key lives in, for messages (the checkpoint's name for a key it lacks)."""
        if key in self.path_of:
            return str(self.path_of[key])
        return str(self.directory / (INDEX if (self.directory / INDEX).is_file() else SINGLE))

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(self.path_of[key]).get_slice(key).get_shape())

    def read(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The `box` (one slice per dimension) of tensor `key`, in the file's dtype, on the CPU."""
        f = self._open(self.path_of[key])
        t = f.get_slice(key)[box] if box else f.get_tensor(key)  # a 0-d tensor has no slice
        self.bytes_read += t.numel() * t.element_size()
        return t


def file_key(names: list[str], keys: set[str], prefix: str) -> str | None:
    """The checkpoint's key for a tensor the model knows by `names` (a tied tensor has several and
    is saved once): as named, without the model's base_model_prefix (GPT-2's hub files say h.0...,
    the LM model transformer.h.0...), or with it (a base model's file under a model with a head)."""
    for name in names:
        candidates = [name]
        if prefix:
            candidates += [name[len(prefix) + 1:]] if name.startswith(prefix + ".") else [f"{prefix}.{name}"]
        for key in candidates:
            if key in keys:
                return key
    return None


def match(ckpt: Checkpoint, groups: dict[str, list[str]], shapes: dict[str, tuple], params: set[str],
          prefix: str) -> dict[str, str]:
    """name -> checkpoint key for every tensor of the model the file holds (each of `groups`: a
    first name and all its names). One line naming the tensor and the file when a parameter is
    missing or a shape differs; buffers the file lacks are left out (the model's init makes them)."""
    keys, out = ckpt.keys(), {}
    for first, names in groups.items():
        key = file_key(names, keys, prefix)
        if key is None:
            if first in params:
                aka = f" (nor as {', '.join(names[1:])})" if len(names) > 1 else ""
                raise BigfitError(f"{ckpt.where()} has no tensor for parameter {first}{aka}: "
                                  "the weights are not this model's (or saved by a transformers version that "
                                  "names them differently)")
            continue
        if ckpt.shape(key) != tuple(shapes[first]):
            raise BigfitError(f"{first}: {ckpt.where(key)} holds {key} with shape {list(ckpt.shape(key))}, "
                              f"the model's is {list(shapes[first])}")
        for name in names:
            out[name] = key
    return out

"""Reading a checkpoint without running it. People download checkpoints and share run directories,
and three kinds of file in one are pickles, which torch would unpickle whole (any class, any call:
a crafted file runs its code when it is read). Here each is read as the data bigfit wrote, or refused:
- DCP's `.metadata`: `Reader` unpickles only the classes DCP's Metadata is made of (ALLOWED: what
  torch 2.11 and 2.13 pickle there, by pickletools on real checkpoints), each by its exact module
  and name (a dotted name would reach through a module's attributes: `metadata.os.system`), and
  takes only data files named as DCP names them, in the checkpoint itself;
- the state dict's non-tensor entries (the optimizers' hyper-parameters), which DCP's planner reads
  with torch.load(weights_only=False): `Planner.load_bytes` reads them with weights_only=True;
- rank-N.pt, bigfit's RNG state: torch.load(weights_only=True), and a dict of uint8 tensors only.
The manifest's CRC-32 (manifest.py) finds damage, not an adversary, who re-seals a crafted file's
marker: these readers are the defence. Everything in bigfit that reads DCP goes through `metadata`
and `load`. config.json goes through transformers without remote code (`model_config`).
"""
from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorStorageMetadata)

from ..errors import BigfitError

_DCP = "torch.distributed.checkpoint."
ALLOWED = {(_DCP + "metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    (_DCP + "filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    # StorageMeta.checkpoint_id: the path it was saved to (pathlib._local from Python 3.13 on)
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath")}
DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")  # FileSystemWriter's names: __RANK_N.distcp


class Refused(BigfitError):
    """A file of a checkpoint that is not the data bigfit wrote there: it is not read."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in ALLOWED and not dtype:
            raise pickle.UnpicklingError(f"it holds {module}.{name}, which is no part of DCP's metadata")
        return getattr(importlib.import_module(module), name)


def metadata(path: Path) -> Metadata:
    """DCP's metadata of checkpoint `path`, unpickled with only its own classes, or Refused."""
    try:
        with open(path / ".metadata", "rb") as f:
            md = _MetadataUnpickler(f).load()
    except OSError as e:
        raise Refused(f"checkpoint {str(path)!r}: its .metadata cannot be read ({e.strerror})") from None
    except Exception as e:  # UnpicklingError, and whatever a crafted stream makes the allowed classes raise
        problem = str(e) or type(e).__name__
    else:
        problem = _problem(md)
    if problem:
        raise Refused(f"checkpoint {str(path)!r}: its .metadata is not DCP's metadata ({problem}); a checkpoint is "
                      "data, never code: it is not read")
    return md


def _problem(md) -> str | None:
    """What in unpickled metadata `md` is not as DCP's writer makes it, or None: allowed classes
    can still be put together otherwise, and DCP would fail on that with a traceback."""
    if not isinstance(md, Metadata):
        return f"it holds a {type(md).__name__}"
    if not (isinstance(md.state_dict_metadata, dict) and isinstance(md.storage_data, dict)):
        return "its entries, or their places in the data files, are no tables"
    for key, entry in md.state_dict_metadata.items():
        tensor = isinstance(entry, TensorStorageMetadata)
        if not (isinstance(key, str) and (tensor or isinstance(entry, BytesStorageMetadata))):
            return f"its entry {key!r} is a {type(entry).__name__}"
        if tensor and not (isinstance(entry.size, torch.Size) and isinstance(entry.chunks, list)
                           and isinstance(getattr(entry.properties, "dtype", None), torch.dtype)):
            return f"its entry {key!r} has no shape, dtype and chunks"
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo)):
            return f"a place in its data files is a {type(info).__name__}"
        if not (isinstance(name, str) and DATA_FILE.match(name)) or getattr(info, "transform_descriptors", None):
            return f"it points at {name!r}, which is no data file of the checkpoint: DCP names them __RANK_N.distcp"
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            return f"its place of {index.fqn!r} in {name} is no offset and length"
    return None


class Reader(FileSystemReader):
    """DCP's reader of checkpoint `path` with `metadata`'s unpickler. Its read_metadata takes no
    `rank`: DCP then never falls back to a per-rank metadata file (bigfit writes none)."""

    def __init__(self, path: Path, saved: Metadata | None = None):
        super().__init__(str(path))
        self._metadata = saved or metadata(Path(path))

    def read_metadata(self) -> Metadata:
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class Planner(DefaultLoadPlanner):
    """DCP's load planner, reading the non-tensor entries (the optimizers' hyper-parameters: floats,
    tuples, names) with torch.load(weights_only=True) where torch's uses weights_only=False."""

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise Refused(f"its entry {fqn!r} is not plain data ({_why(e)}); "
                          "a checkpoint is data, never code: it is not read") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load(state: dict, path: Path, planner: Planner | None = None, saved: Metadata | None = None,
         no_dist: bool = False) -> None:
    """dcp.load of `state` from checkpoint `path` through `Reader` and `planner` (a `Planner`);
    `saved`: its metadata, read already. A refused entry is Refused here; DCP's other failures stay
    its CheckpointException."""
    reader = Reader(path, saved)  # the metadata first, outside DCP: there a refusal would be a logged warning
    try:
        dcp.load(state, storage_reader=reader, planner=planner or Planner(), no_dist=no_dist)
    except CheckpointException as e:  # a BaseException: it carries every rank's failure
        refused = [f[0] for f in e.failures.values() if isinstance(f[0], Refused)]
        if refused:
            raise Refused(f"checkpoint {str(path)!r}: {refused[0]}") from None
        raise


def rng_state(path: Path) -> dict[str, torch.Tensor]:
    """rank-N.pt: {"cpu": [, "cuda":] uint8 tensor}, read with weights_only=True (checkpoints of
    every bigfit version wrote it with torch.save), or Refused."""
    where = f"checkpoint {str(path.parent)!r}: its {path.name}"
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise Refused(f"{where} is not an RNG state ({_why(e)}); "
                      "a checkpoint is data, never code: it is not read") from None
    if not (isinstance(state, dict) and "cpu" in state and set(state) <= {"cpu", "cuda"}
            and all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in state.values())):
        raise Refused(f"{where} is not an RNG state bigfit wrote (a dict of uint8 tensors under 'cpu' and 'cuda')")
    return state


def _why(e: Exception) -> str:
    """torch.load's refusal in a few words: its WeightsUnpickler line ("Unsupported global: GLOBAL
    io.open was not an allowed global by default"), not its advice to load the file unsafely."""
    text = str(e)
    reason = text.partition("WeightsUnpickler error: ")[2] or text
    return reason.split(". ")[0].splitlines()[0].strip() if reason.strip() else type(e).__name__


def model_config(path: Path):
    """The model config in directory `path` (a checkpoint's config.json) by transformers' own classes:
    no remote code (a config naming code of its own, `auto_map`, is refused unless its model type is
    one transformers has), and its auto_map dropped, so no later from_config looks for that code."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise Refused(f"checkpoint {str(path)!r}: its config.json is no model config transformers has "
                      f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); bigfit runs no code from a "
                      "checkpoint") from None
    _without_code(config)
    return config


def _without_code(config) -> None:
    """`config` and the configs inside it (an encoder's, a text model's) without their auto_map."""
    from transformers import PretrainedConfig

    config.__dict__.pop("auto_map", None)
    for inner in [v for v in vars(config).values() if isinstance(v, PretrainedConfig)]:
        _without_code(inner)

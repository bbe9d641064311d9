"""`bigfit consolidate`: a sharded DCP checkpoint -> one Hugging Face model directory.

Streaming: tensors are read from the checkpoint a shard's worth at a time (DCP loads just the keys
asked for, from every rank's files) and written as safetensors shards with an index, so this
process holds at most one output shard, never the whole model. Tied weights (T5's shared
embedding and lm_head, GPT-2's wte and head) are written once, under the name the model's own
parameter list gives first; transformers ties them again on load.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import BigfitError
from .checkpoint import is_checkpoint

ASSETS_EXCLUDE = {"trainer.json", "COMPLETE", ".metadata"}


def _canonical_names(ckpt: Path, keys: set[str]) -> list[str]:
    """Checkpoint keys minus aliases of tied parameters, found on a weightless (meta) copy of the model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = AutoConfig.from_pretrained(ckpt)
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    first: dict[int, str] = {}
    order = []
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if first.setdefault(id(t), name) == name:
            order.append(name)
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(order)
    return [n for n in order if n in keys] + sorted(keys - set(order) - aliases)


def _plan_shards(meta: dict, names: list[str], max_bytes: int) -> list[list[str]]:
    shards, cur, size = [], [], 0
    for n in names:
        t = meta[n]
        nbytes = t.size.numel() * t.properties.dtype.itemsize
        if cur and size + nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += nbytes
    return shards + ([cur] if cur else [])


def consolidate(ckpt: str | Path, out: str | Path, max_shard_bytes: int = 2 << 30) -> Path:
    ckpt, out = Path(ckpt), Path(out)
    if not is_checkpoint(ckpt):
        raise BigfitError(f"{str(ckpt)!r} is not a complete bigfit checkpoint (a step-N directory with a "
                          "COMPLETE marker, under OUTPUT/checkpoints)")
    meta = {k[len("model."):]: v for k, v in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    names = _canonical_names(ckpt, set(meta))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = _plan_shards(meta, names, max_shard_bytes)
    index = {}
    for i, shard in enumerate(shards, 1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: torch.empty(meta[n].size, dtype=meta[n].properties.dtype) for n in shard}
        with warnings.catch_warnings():  # "no process group: loading in one process" is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({f"model.{n}": t for n, t in tensors.items()}, checkpoint_id=str(ckpt), no_dist=True)
        save_file(tensors, tmp / fname, metadata={"format": "pt"})
        index.update({n: fname for n in shard})
        del tensors
    if len(shards) > 1:
        total = sum(meta[n].size.numel() * meta[n].properties.dtype.itemsize for n in names)
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    for f in ckpt.iterdir():  # config.json, generation_config.json, tokenizer files
        if f.is_file() and f.name not in ASSETS_EXCLUDE and f.suffix != ".distcp" and not f.name.startswith("rank-"):
            shutil.copy2(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out

"""Python objects given to `bigfit.train` in place of paths: a model (a transformers PreTrainedModel,
with its tokenizer), a datasets.Dataset or DatasetDict, or a list of example dicts. bigfit's workers
are new processes (a notebook that touched CUDA must not fork), so each object is written once to a
directory named by a digest of its content, under $XDG_CACHE_HOME/bigfit/inputs, and the run reads that
path as it would the user's own: the same object given again is the same path, so a resumed run sees
the same model and data. The user's object is read, never changed; bigfit deletes none of these
directories (remove them to reclaim the space)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..errors import BigfitError


def root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bigfit" / "inputs"


def model_path(model, tokenizer=None) -> str:
    """A directory holding `model` (save_pretrained: config and safetensors weights) and `tokenizer`."""
    import torch
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise BigfitError(f"model= takes a hub name, a directory or a transformers PreTrainedModel; got "
                          f"{type(model).__name__}")
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, t in model.state_dict().items():  # every byte: a model trained further in the notebook is another model
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    if tokenizer is not None:
        h.update(type(tokenizer).__name__.encode() + json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    return str(_written(root() / "models" / h.hexdigest()[:24], lambda d: _save_model(model, tokenizer, d)))


def data_path(data) -> str:
    """A path holding `data`: a saved dataset directory, or a JSONL file of the example dicts."""
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None and isinstance(data, (datasets.Dataset, datasets.DatasetDict)):
        key = data._fingerprint if isinstance(data, datasets.Dataset) else "-".join(
            f"{k}:{v._fingerprint}" for k, v in sorted(data.items()))
        return str(_written(root() / "datasets" / hashlib.sha256(key.encode()).hexdigest()[:24],
                            lambda d: data.save_to_disk(str(d))))
    if isinstance(data, (list, tuple)) and data and all(isinstance(e, dict) for e in data):
        lines = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in data)
        digest = hashlib.sha256(lines.encode()).hexdigest()[:24]
        return str(_written(root() / "examples" / digest, lambda d: (d / "examples.jsonl").write_text(lines))
                   / "examples.jsonl")
    raise BigfitError(f"data= takes a path, a hub dataset name, a datasets.Dataset or DatasetDict, or a list of example "
                      f"dicts; got {type(data).__name__}{' (empty)' if isinstance(data, (list, tuple)) else ''}")


def _save_model(model, tokenizer, where: Path) -> None:
    model.save_pretrained(str(where), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(where))


def _written(where: Path, write) -> Path:
    """`where`, written by `write(dir)` unless an earlier call wrote it (whole: written aside, then renamed)."""
    if where.exists():
        return where
    tmp = where.with_name(f"{where.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    try:
        os.rename(tmp, where)
    except OSError:  # another process wrote the same content first
        shutil.rmtree(tmp, ignore_errors=True)
    return where

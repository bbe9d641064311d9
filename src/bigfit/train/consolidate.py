"""`bigfit consolidate`: a sharded DCP checkpoint -> one Hugging Face model directory.

Streaming: tensors are read from the checkpoint a shard's worth at a time (DCP loads just the keys
asked for, from every rank's files) and written as safetensors shards with an index, so this
process holds at most one output shard, never the whole model. Tied weights (T5's shared
embedding and lm_head, GPT-2's wte and head) are written once, under the name the model's own
parameter list gives first; transformers ties them again on load.

Nothing the user owns is deleted: the checkpoint is verified first (its manifest), the directory
is written beside its destination and renamed into place, and it carries bigfit-model.json, the
list of files bigfit wrote, which is all that a later `--overwrite` replaces.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import BigfitError
from .ckptdir import NAME, verify
from .rundir import MODEL_MARKER, check_location, model_files

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


def consolidate(ckpt: str | Path, out: str | Path, max_shard_bytes: int = 2 << 30, overwrite: bool = False,
                legacy: bool = False) -> Path:
    """Write checkpoint `ckpt` as a Hugging Face model directory `out`. `out` appears whole or not at
    all (written as a hidden sibling, then renamed); an existing `out` must be empty, or a model
    directory bigfit wrote with `overwrite` given (`legacy`: or one written before model directories
    had a marker), and then only the files bigfit wrote there are replaced: others are kept."""
    given, ckpt, out = Path(out), Path(ckpt), Path(os.path.abspath(Path(out).expanduser()))
    if not (ckpt.is_dir() and NAME.match(ckpt.name)):
        raise BigfitError(f"{str(ckpt)!r} is not a complete bigfit checkpoint (a step-N directory with a "
                          "COMPLETE marker, under OUTPUT/checkpoints)")
    verify(ckpt, "consolidate that one: bigfit consolidate {} OUT")
    replaced = _target(out, overwrite, legacy)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed consolidation of this pid's
    try:
        tmp.mkdir(parents=True)
        _write(ckpt, tmp, max_shard_bytes)
        _install(tmp, out, replaced)
    except OSError as e:
        raise BigfitError(f"consolidate could not write {str(out)!r}: {e.strerror or e} ({e.filename or out})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return given


def _target(out: Path, overwrite: bool, legacy: bool) -> list[Path] | None:
    """None: `out` is new; else the files in it that the new model replaces (none: it is empty)."""
    check_location(out, "consolidate: the model directory")
    if out == Path.cwd() or out in Path.cwd().parents:
        raise BigfitError(f"consolidate: {str(out)!r} is the current directory (or holds it); give a new directory, "
                          "e.g. ./model")
    if not out.exists():
        return None
    entries = list(out.iterdir())
    files = model_files(out, legacy)
    if entries and files is None:
        raise BigfitError(f"consolidate: {str(out)!r} holds files bigfit did not write (e.g. {entries[0].name!r}); "
                          "give a new or empty directory")
    if files and not overwrite:
        raise BigfitError(f"consolidate: {str(out)!r} holds a model bigfit wrote earlier; replace it with "
                          "--overwrite (only its model files: others are kept), or give a new directory")
    return files or []


def _write(ckpt: Path, tmp: Path, max_shard_bytes: int) -> None:
    """The safetensors shards (and index), the checkpoint's config and tokenizer, and the marker."""
    meta = {k[len("model."):]: v for k, v in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    names = _canonical_names(ckpt, set(meta))
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
    written = sorted(p.name for p in tmp.iterdir())
    (tmp / MODEL_MARKER).write_text(json.dumps({"files": written, "checkpoint": str(ckpt.absolute()),
                                                "written": time.time()}, indent=1))


def _install(tmp: Path, out: Path, replaced: list[Path] | None) -> None:
    """Put `tmp` in `out`'s place. Files of an existing `out` that are not `replaced` move into the
    new directory first; the old one, left with only replaced files, is removed after the swap."""
    if replaced is None or not any(out.iterdir()):
        os.replace(tmp, out)  # onto nothing, or onto an empty directory: one rename
        return
    kept = [p for p in out.iterdir() if p not in replaced]
    if clash := [p.name for p in kept if (tmp / p.name).exists()]:
        raise BigfitError(f"consolidate: {str(out)!r} holds {clash[0]!r}, which bigfit did not write there but the "
                          "new model has a file of that name; move it away first")
    old, moved = out.parent / f".{out.name}.old-{os.getpid()}", []
    try:
        for p in kept:
            os.rename(p, tmp / p.name)
            moved.append(p)
        os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:  # Ctrl-C too: put everything back where it was before the caller removes tmp
        _put_back(tmp, out, old, moved)
        raise
    shutil.rmtree(old)


def _put_back(tmp: Path, out: Path, old: Path, moved: list[Path]) -> None:
    """Undo a swap that failed half way; should that fail too, the user's files stay where they are
    now, in a directory that is kept and named (tmp, which the caller removes, is then empty)."""
    try:
        if old.exists() and not out.exists():
            os.rename(old, out)
        for p in moved:
            os.rename(tmp / p.name, p)
    except OSError as e:
        rescued = tmp.with_name(tmp.name.replace(".partial-", ".rescued-"))
        os.rename(tmp, rescued)
        raise BigfitError(f"consolidate failed while replacing {str(out)!r} and could not put everything back "
                          f"({e.strerror}): your files are in {str(rescued)!r}") from None

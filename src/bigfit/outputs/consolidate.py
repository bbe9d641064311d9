"""`bigfit consolidate`: a sharded DCP checkpoint -> one Hugging Face model directory, or, for a
`--lora` checkpoint, a peft adapter directory (or with `merge` a model with the adapters folded in:
outputs/adapter.py, into the frozen base the checkpoint does not hold, made again: outputs/basesource.py).

Streaming: tensors are read from the checkpoint a shard's worth at a time (DCP loads just the keys
asked for, from every rank's files) and written as safetensors shards with an index, so this
process holds at most one output shard, never the whole model. Tied weights (T5's shared
embedding and lm_head, GPT-2's wte and head) are written once, under the name the model's own
parameter list gives first; transformers ties them again on load.

Nothing the user owns is deleted: the checkpoint is verified first (its manifest), the directory
is written beside its destination and renamed into place, and it carries bigfit-model.json, each
file bigfit wrote with its size and CRC-32: a later `--overwrite` replaces those of them that still
match it (records.py), moves every other file into the new directory, and replaces a symbolic link
given as the destination by the directory, leaving what the link pointed to as it was.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import BigfitError
from . import safeload
from .adapter import A, LoraCheckpoint
from .basesource import Held, RebuiltBase
from .ckptdir import NAME, frozen_of, trainer_state, verify
from .records import MODEL_MARKER, model_marker, model_named, model_record, split
from .rundir import check_location, check_outside

ASSETS_EXCLUDE = {"trainer.json", "COMPLETE", ".metadata"}
MODEL_ONLY = {"config.json", "generation_config.json"}  # in an adapter directory they would pose as a model


def consolidate(ckpt: str | Path, out: str | Path, max_shard_bytes: int = 2 << 30, overwrite: bool = False,
                merge: bool = False, base: str | None = None) -> Path:
    """Write checkpoint `ckpt` as a Hugging Face model directory `out`; a `--lora` checkpoint as a
    peft adapter directory, or with `merge` as a model with its adapters folded into the base
    weights (made again from the run's --model, or from `base` where that moved). `out` appears
    whole or not at all (written as a hidden sibling, then renamed); an existing `out` must be
    empty, or be replaced with `overwrite` given, and then only the files bigfit wrote there (its
    marker lists them, and they still match it) are removed: others are kept in the new directory."""
    given, ckpt, out = Path(out), Path(ckpt), Path(os.path.abspath(Path(out).expanduser()))
    if not (ckpt.is_dir() and NAME.match(ckpt.name)):
        raise BigfitError(f"{str(ckpt)!r} is not a complete bigfit checkpoint (a step-N directory with a "
                          "COMPLETE marker, under OUTPUT/checkpoints)")
    if base is not None and not merge:
        raise BigfitError(f"--base {base!r} is the base model to merge the adapters into: give it with --merge, "
                          "or drop it")
    verify(ckpt, "consolidate that one: bigfit consolidate {} OUT")
    lora, held = _lora(ckpt, merge, base)
    adapter = lora is not None and not merge
    replaced = _target(out, overwrite, "adapter" if adapter else "model")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed consolidation of this pid's
    try:
        tmp.mkdir(parents=True)
        if adapter:
            _write_adapter(ckpt, tmp, held, lora)
        else:
            _write(ckpt, tmp, held, max_shard_bytes, lora)
        _install(tmp, out, replaced)
    except OSError as e:
        raise BigfitError(f"consolidate could not write {str(out)!r}: {e.strerror or e} ({e.filename or out})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return given


def _config(ckpt: Path):
    return safeload.model_config(ckpt)  # transformers' own classes: no code from the checkpoint


def _meta_model(ckpt: Path) -> torch.nn.Module:
    """The checkpoint's base model on the meta device (its config.json; no weights)."""
    from ..models.source import meta_model

    config = _config(ckpt)
    try:
        return meta_model(config)
    except ValueError as e:  # a config class transformers has, but no language model of it
        raise BigfitError(f"checkpoint {str(ckpt)!r}: its config.json describes a {config.model_type!r} model, "
                          "which transformers has no causal or seq2seq language model of "
                          f"({str(e).splitlines()[0]})") from None


def _lora(ckpt: Path, merge: bool, base: str | None) -> tuple[LoraCheckpoint | None, Held]:
    """The checkpoint's tensors, and its adapters (None for a full fine-tuning checkpoint). Told by its
    keys (what was trained), its settings (r, alpha) by trainer.json. To merge, a checkpoint without
    its frozen base (a LoRA run's; QLoRA's too: its full-precision base) gets that base made again."""
    held = Held(ckpt)
    if not any(n.endswith(A) for n in held.names):
        if merge:
            raise BigfitError(f"--merge is for LoRA checkpoints (trained with --lora); {str(ckpt)!r} is a full "
                              "fine-tuning checkpoint: consolidate it without --merge")
        return None, held
    trainer = trainer_state(ckpt)
    if merge and not frozen_of(trainer)["in_checkpoint"]:
        held = Held(ckpt, RebuiltBase(trainer, _config(ckpt), base))
    elif base is not None:
        raise BigfitError(f"--base {base!r}: checkpoint {str(ckpt)!r} holds its base weights itself; drop --base")
    return LoraCheckpoint(trainer["config"], held.names, _meta_model(ckpt)), held


def _canonical_names(model: torch.nn.Module, keys: set[str]) -> list[str]:
    """`keys` minus aliases of tied parameters, in the order of the (meta) model's own tensors."""
    first: dict[int, str] = {}
    order = []
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if first.setdefault(id(t), name) == name:
            order.append(name)
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(order)
    return [n for n in order if n in keys] + sorted(keys - set(order) - aliases)


def _plan_shards(sizes: dict[str, int], names: list[str], max_bytes: int) -> list[list[str]]:
    shards, cur, size = [], [], 0
    for n in names:
        if cur and size + sizes[n] > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += sizes[n]
    return shards + ([cur] if cur else [])


def _target(out: Path, overwrite: bool, kind: str = "model") -> list[Path] | None:
    """None: `out` is new; else what the new directory replaces: the files bigfit wrote in it (none:
    it is empty, or holds only others, which are kept), or `out` itself where it is a link."""
    check_location(out, f"consolidate: the {kind} directory")
    if out == Path.cwd() or out in Path.cwd().parents:
        raise BigfitError(f"consolidate: {str(out)!r} is the current directory (or holds it); give a new directory, "
                          f"e.g. ./{kind}")
    check_outside(out, f"consolidate: the {kind} directory", itself=False)
    if out.is_symlink():
        if not overwrite:
            raise BigfitError(f"consolidate: {str(out)!r} is a symbolic link (to {os.readlink(out)!r}); replace the "
                              "link with --overwrite (what it points to is kept as it is), or give a directory")
        return [out]
    if not out.exists():
        return None
    entries = sorted(out.iterdir())
    record = model_record(out)
    if entries and not overwrite and record is None:
        raise BigfitError(f"consolidate: {str(out)!r} holds files bigfit did not write (e.g. {entries[0].name!r}); "
                          "give a new or empty directory")
    if entries and not overwrite:
        raise BigfitError(f"consolidate: {str(out)!r} holds a model or adapter bigfit wrote earlier; replace it "
                          "with --overwrite (only the files bigfit wrote: others are kept), or give a new directory")
    ours, kept = split(out, record, MODEL_MARKER, exact=True)
    if clash := [p.name for p in kept if p.parent == out and model_named(p.name)]:  # before the model is written
        raise BigfitError(_clash(out, clash[0]))
    return ours


def _write(ckpt: Path, tmp: Path, held: Held, max_shard_bytes: int, lora: LoraCheckpoint | None) -> None:
    """The safetensors shards (and index), the checkpoint's config and tokenizer, and the marker;
    with `lora`, under the base model's names with the adapters merged."""
    sources = lora.sources() if lora else {n: [n] for n in held.names}  # output name -> the run's names
    names = _canonical_names(lora.base if lora else _meta_model(ckpt), set(sources))
    if lora and (tied := sorted(lora.targeted() - set(names))):  # its delta would be dropped with the alias
        raise BigfitError(f"--merge: the adapter on {tied[0]!r} trains a weight tied to another, which a merged "
                          "model stores once; consolidate without --merge and load the adapter with peft")
    sizes = {n: held.nbytes(sources[n][0]) for n in names}
    shards = _plan_shards(sizes, names, max_shard_bytes)
    index = {}
    for i, shard in enumerate(shards, 1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        got = held.read([s for n in shard for s in sources[n]])
        tensors = {n: lora.merged(n, sources[n], got) if lora else got[n] for n in shard}
        save_file(tensors, tmp / fname, metadata={"format": "pt"})
        index.update({n: fname for n in shard})
        del tensors, got
    if len(shards) > 1:
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": index}, indent=1))
    _finish(ckpt, tmp, "model")


def _write_adapter(ckpt: Path, tmp: Path, held: Held, lora: LoraCheckpoint) -> None:
    """What PeftModel.save_pretrained writes (adapter_config.json, adapter_model.safetensors), the
    tokenizer, and the marker."""
    config = lora.peft_config()  # first: without peft, fail before reading anything
    tensors = lora.adapter_tensors(held.read)
    save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(str(tmp))
    _finish(ckpt, tmp, "adapter")


def _finish(ckpt: Path, tmp: Path, kind: str) -> None:
    """The checkpoint's assets (config.json, generation_config.json for a model; tokenizer files),
    then the marker listing every file written."""
    for f in ckpt.iterdir():
        if (f.is_file() and f.name not in ASSETS_EXCLUDE and f.suffix != ".distcp" and not f.name.startswith("rank-")
                and not (kind == "adapter" and f.name in MODEL_ONLY)):
            shutil.copy2(f, tmp / f.name)
    written = sorted(p.name for p in tmp.iterdir())
    (tmp / MODEL_MARKER).write_text(model_marker(tmp, written, kind=kind, checkpoint=str(ckpt.absolute()),
                                                 written=time.time()))


def _install(tmp: Path, out: Path, replaced: list[Path] | None) -> None:
    """Put `tmp` in `out`'s place. Files of an existing `out` that are not `replaced` move into the
    new directory first (a link among them moves as a link); the old one, left with only replaced
    files, is removed after the swap. A link `out` is removed as a link."""
    if replaced is not None and out.is_symlink():
        out.unlink()  # the link only: what it points to stays as it was
        replaced = None
    if replaced is None or not any(out.iterdir()):
        os.replace(tmp, out)  # onto nothing, or onto an empty directory: one rename
        return
    kept = [p for p in out.iterdir() if p not in replaced]
    if clash := [p.name for p in kept if (tmp / p.name).exists()]:
        raise BigfitError(_clash(out, clash[0]))
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
    for p in replaced:
        (old / p.name).unlink(missing_ok=True)
    old.rmdir()


def _clash(out: Path, name: str) -> str:
    return (f"consolidate: {str(out)!r} holds {name!r}, which no record of bigfit's matches (bigfit did not write it "
            "there, or it changed since) where the new model has a file of that name; move it away first")


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

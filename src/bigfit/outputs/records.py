"""bigfit's records of the files it wrote, and which files on disk still match them: what
`--overwrite` (rundir.py, overwrite.py) and `bigfit consolidate --overwrite` may remove.

Two directories carry their own record: a checkpoint's COMPLETE marker holds its manifest (every
file's size and CRC-32, manifest.py) and a model or adapter directory's bigfit-model.json holds the
same for its files (written by consolidate.py). A file is bigfit's while its path is recorded and
its size and CRC-32 are the recorded ones; one that changed since (a user edited config.json, or
saved other weights of the same size over model.safetensors) is no longer bigfit's to remove.

Nothing here follows a symbolic link: a link is an entry of its own (removing it removes the link,
never what it points to), and a directory is only looked into when it is a real one.
"""
from __future__ import annotations

import json
import os
import re
from fnmatch import fnmatchcase
from pathlib import Path

from . import manifest
from .ckptdir import MARKER

MODEL_MARKER = "bigfit-model.json"  # in a model directory bigfit wrote: each file it wrote, its size and CRC-32
# The names a consolidation writes into a model or adapter directory (the model's files, a tokenizer's,
# peft's): a file of one of them that is not bigfit's stands where a consolidation would write
MODEL_NAMES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
               "model.safetensors.index.json", "adapter_config.json", "adapter_model.safetensors", "tokenizer*",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
               "chat_template.jinja", MODEL_MARKER)
# DCP's data shards: checked by size alone. Nothing but DCP writes one, and reading them all would read
# every checkpoint whole before removing it (12 bytes a parameter each: 84 GB for a 7B model, 30 s a
# checkpoint at the 2.8 GB/s one core checksums); every other file is checked by its bytes too.
SHARD = re.compile(r"^__\d+_\d+\.distcp$")


def model_named(name: str) -> bool:
    """Whether a consolidation may write a file of that name into a model or adapter directory."""
    return any(fnmatchcase(name, n) for n in MODEL_NAMES)


def entries(top: Path) -> list[Path]:
    """Every file and link under the real directory `top`, looking into real directories only; a
    link (to a directory too) is an entry, what it points to is not looked at."""
    found = []
    for e in sorted(os.scandir(top), key=lambda e: e.name):
        if e.is_dir(follow_symlinks=False):
            found += entries(Path(e.path))
        else:
            found.append(Path(e.path))
    return found


def read(marker: Path) -> str | None:
    """The text of a record file; None where it is missing, a link or unreadable."""
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        return marker.read_text(errors="replace")
    except OSError:
        return None


def checkpoint_record(ckpt: Path) -> dict[str, list] | None:
    """{relative name: [size, [CRC-32s]]} that checkpoint `ckpt`'s intact COMPLETE marker lists; None
    without one (no marker, a damaged one, or one of the older form that lists no files)."""
    body = manifest.unseal(read(ckpt / MARKER) or "")
    return _valid(body.get("files")) if isinstance(body, dict) else None


def model_record(directory: Path) -> dict[str, list] | None:
    """{name: [size, [CRC-32s]]} that `directory`'s bigfit-model.json lists; None without one (no
    marker, an unreadable one, or one of the older form that lists names without sizes and checksums).
    Plain names only: a marker edited to hold "../x" names nothing outside the directory."""
    try:
        files = json.loads(read(directory / MODEL_MARKER) or "")["files"]
    except (ValueError, KeyError, TypeError):
        return None
    record = _valid(files)
    return None if record is None else {n: v for n, v in record.items() if Path(n).name == n and n not in (".", "..")}


def _valid(files) -> dict[str, list] | None:
    """`files` when it is a manifest's {name: [size, [CRC-32s]]}; entries of another shape are dropped."""
    if not isinstance(files, dict):
        return None
    ok = lambda v: (isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], list)  # noqa: E731
                    and all(isinstance(c, int) for c in v[1]))
    return {n: v for n, v in files.items() if isinstance(n, str) and ok(v)}


def model_marker(directory: Path, names: list[str], **fields) -> str:
    """The text of bigfit-model.json for the files `names` in `directory`: each one's size and CRC-32s."""
    return json.dumps({"files": manifest.describe(directory, names), **fields}, indent=1)


def split(top: Path, record: dict[str, list] | None, marker: str, exact: bool) -> tuple[list[Path], list[Path]]:
    """(bigfit's, others) of the entries of the real directory `top` against its `record` (None: it has
    none, so nothing in it is bigfit's). bigfit's: each file the record lists with its size and (with
    `exact`; a DCP shard by its size alone) its CRC-32s, the marker `marker` that holds the record, and
    a link standing where the record lists a file (removing a link removes nothing it points to)."""
    ours, kept, sized = [], [], []
    for p in entries(top):
        name = p.relative_to(top).as_posix()
        if record is None or (name not in record and name != marker):
            kept.append(p)
        elif p.is_symlink() or name == marker:
            ours.append(p)
        elif p.is_file() and p.stat().st_size == record[name][0]:
            sized.append(p)
        else:
            kept.append(p)
    check = [p.relative_to(top).as_posix() for p in sized if exact and not SHARD.match(p.name)]
    found = manifest.describe(top, check) if check else {}
    for p in sized:
        name = p.relative_to(top).as_posix()
        (ours if name not in found or found[name][1] == record[name][1] else kept).append(p)
    return ours, kept

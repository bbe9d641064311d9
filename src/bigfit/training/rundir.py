"""What an output directory holds and what a run may do to it: bigfit removes only files it
recognises as its own (a step-N checkpoint, metrics.jsonl, a model directory with its marker, its
logs and NVMe state files), never anything else a user keeps there; and it checks a location before
any process starts (a file in the way, a read-only file system, no write permission, no room).

A run's files in OUTPUT:
    run.json              the run's identity: id, model, data and its hash, bigfit version, starts
    metrics.jsonl, eval.jsonl
    checkpoints/step-N/   complete checkpoints; .step-N.partial: interrupted saves
    model/                the consolidated Hugging Face directory, with bigfit-model.json listing its files
    adapter/              a --lora run's instead: its peft adapter directory, with the same marker
    logs/, nvme/          worker logs; zero2-offload-nvme's state files (the default --nvme-dir)
    .bigfit-lock          held while the run runs (lock.py)
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BigfitError
from .ckptdir import steps

RUN_FILE = "run.json"
LOGS = ("metrics.jsonl", "eval.jsonl")
MODEL_MARKER = "bigfit-model.json"  # in a model directory bigfit wrote: the files it wrote there
# What `bigfit consolidate` wrote before model directories had a marker (and tokenizers' files)
LEGACY_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                      "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
                      "vocab.json", "merges.txt", "spiece.model", "chat_template.jinja")


@dataclass
class Contents:
    """bigfit's files in one output directory."""

    root: Path
    run: dict | None = None  # run.json, when there is one
    checkpoints: list[Path] = field(default_factory=list)  # step-N directories, newest first
    partial: list[Path] = field(default_factory=list)  # interrupted saves
    logs: list[Path] = field(default_factory=list)  # metrics.jsonl, eval.jsonl
    model: list[Path] = field(default_factory=list)  # the files of OUTPUT/model and OUTPUT/adapter bigfit wrote
    other: list[Path] = field(default_factory=list)  # run.json, worker logs, NVMe state files

    @property
    def holds_run(self) -> bool:
        """A run trained here: it left checkpoints, step logs or a model (run.json and worker logs
        alone are a start that failed before its first step)."""
        return bool(self.checkpoints or self.partial or self.logs or self.model)

    def describe(self) -> str:
        parts = []
        if self.checkpoints:
            parts.append(f"{len(self.checkpoints)} checkpoint(s), newest {self.checkpoints[0].name}")
        parts += [p.name for p in self.logs] + sorted({f"{p.parent.name}/" for p in self.model})
        started = f"the run {self.run['run_id']}" if self.run else "a bigfit run"
        return f"{started} ({', '.join(parts) or 'interrupted saves'})"


def model_files(directory: Path, legacy: bool = False) -> list[Path] | None:
    """The files bigfit wrote into model directory `directory` (its marker included), or None when
    its marker is missing or unreadable. `legacy`: without a marker, the files the consolidation of
    earlier bigfit versions wrote (for a model directory inside a bigfit run's output only)."""
    marker = directory / MODEL_MARKER
    try:
        names = json.loads(marker.read_text())["files"]
        # plain names only: a marker edited to hold "../x" must not reach outside the directory
        return [directory / n for n in names if Path(n).name == n and (directory / n).is_file()] + [marker]
    except (OSError, ValueError, KeyError, TypeError):
        if not legacy or not directory.is_dir():
            return None
        return [p for p in directory.iterdir() if p.is_file()
                and any(fnmatch.fnmatch(p.name, pat) for pat in LEGACY_MODEL_FILES)]


def inspect(root: Path) -> Contents:
    c = Contents(root)
    if not root.is_dir():
        return c
    try:
        c.run = json.loads((root / RUN_FILE).read_text())
        c.other.append(root / RUN_FILE)
    except (OSError, ValueError):
        pass
    c.checkpoints = steps(root / "checkpoints")
    c.partial = [p for p in (root / "checkpoints").glob(".step-*.partial") if p.is_dir()]
    c.logs = [root / n for n in LOGS if (root / n).is_file()]
    c.model = (model_files(root / "model", legacy=True) or []) + (model_files(root / "adapter") or [])
    c.other += [p for pat in ("logs/rank-*.log", "logs/probe/rank-*.log", "nvme/rank-*/bucket-*.bin")
                for p in root.glob(pat)]
    return c


def remove_run(c: Contents) -> None:
    """Delete the run's files that `c` lists, then the folders bigfit made for them if nothing else
    is left in them; files bigfit does not recognise stay where they are."""
    for d in c.checkpoints + c.partial:
        shutil.rmtree(d)
    for f in c.logs + c.model + c.other:
        f.unlink(missing_ok=True)
    made = {f.parent for f in c.other} | {c.root / d for d in ("checkpoints", "model", "adapter", "logs/probe", "logs",
                                                               "nvme")}
    for d in sorted(made - {c.root}, key=lambda d: len(d.parts), reverse=True):  # the deepest first
        with contextlib.suppress(OSError):
            d.rmdir()  # only when nothing else is left in it


def check_location(path: Path, what: str) -> None:
    """`path` is a directory bigfit may create or write into: nothing in the way, the nearest folder
    that exists writable, not on a read-only file system. Touches nothing."""
    if path.exists() and not path.is_dir():
        raise BigfitError(f"{what} {str(path)!r} is a file, not a directory; give a directory (it is created "
                          "if missing)")
    near = _nearest(path)
    if not near.is_dir():
        raise BigfitError(f"{what} {str(path)!r} cannot be created: {str(near)!r} is a file")
    if os.statvfs(near).f_flag & os.ST_RDONLY:
        raise BigfitError(f"{what} {str(path)!r} is on a read-only file system; give a directory on a writable "
                          "disk")
    if not os.access(near, os.W_OK | os.X_OK):
        raise BigfitError(f"{what} {str(path)!r}: {str(near)!r} is not writable by this user; give a directory "
                          "you can write to")


def free_bytes(path: Path) -> int:
    st = os.statvfs(_nearest(path))
    return st.f_bavail * st.f_frsize


def _nearest(path: Path) -> Path:
    """`path`, or the nearest folder above it that exists (where it would be created)."""
    while not path.exists():
        path = path.parent
    return path

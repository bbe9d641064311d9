"""What an output directory holds and what a run may do to it: bigfit removes only the files its
records say it wrote, and only while they still match them; it checks a location before any
process starts (a file in the way, a read-only file system, no write permission, no room, a
checkpoint or model directory around it).

A run's files in OUTPUT, and the record that makes each one bigfit's:
    run.json              the run's identity, and the paths below that the run writes (runinfo.py)
    job.json              the resolved job its processes run (job/resolution.py), by those paths too
    metrics.jsonl, eval.jsonl, logs/, nvme/      by those paths: step logs, worker and probe logs,
                          zero2-offload-nvme's state files (the default --nvme-dir)
    checkpoints/step-N/   by its COMPLETE marker's manifest (each file's size and CRC-32);
                          .step-N.partial (interrupted saves) by run.json's paths
    model/ or adapter/    by its bigfit-model.json (each file's size and CRC-32)
    .bigfit-lock          held while the run runs (lock.py)
A file no record matches (one a user added, or changed since bigfit wrote it) is kept; a symbolic
link where bigfit writes is removed as a link, what it points to untouched (records.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from ..errors import BigfitError
from . import records
from .ckptdir import MARKER, NAME, step_of
from .records import MODEL_MARKER

RUN_FILE = "run.json"
LOGS = ("metrics.jsonl", "eval.jsonl")
# The paths a run writes besides its checkpoints and model directory (run.json records them)
RUN_PATHS = ("metrics.jsonl", "eval.jsonl", "metrics.tmp", "eval.tmp", "run.json.tmp", "job.json", "job.json.partial",
             "checkpoints/.step-*.partial/*", "logs/probe/job.json", "logs/probe/job.json.partial",
             "logs/rank-*.log", "logs/error.txt", "logs/probe/rank-*.log", "logs/probe/error.txt", "logs/probe/search.json",
             "logs/probe/search.partial", "logs/probe/device_map.json", "logs/probe/deadline.json",
             "logs/probe/deadline.partial", "logs/probe/waited.txt", "nvme/rank-*/bucket-*.bin")
FOLDERS = ("checkpoints", "model", "adapter", "logs", "nvme")  # the folders bigfit makes in OUTPUT
SUBFOLDERS = ("logs/probe", "nvme/rank-*")  # and in them: a link there is removed as one
PARTIAL = re.compile(r"^\.step-\d+\.partial$")
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
           "adapter_model.safetensors", "adapter_model.bin")


@dataclass
class Contents:
    """bigfit's files in one output directory, and what is where bigfit writes without being its own."""

    root: Path
    run: dict | None = None  # run.json, when there is one
    checkpoints: list[Path] = field(default_factory=list)  # step-N directories (or links), newest first
    partial: list[Path] = field(default_factory=list)  # interrupted saves
    logs: list[Path] = field(default_factory=list)  # metrics.jsonl, eval.jsonl
    model: list[Path] = field(default_factory=list)  # OUTPUT/model's or adapter's files bigfit wrote (or the link)
    links: list[Path] = field(default_factory=list)  # links where bigfit writes
    gone: list[Path] = field(default_factory=list)  # what --overwrite removes: files a record matches, and links
    kept: list[Path] = field(default_factory=list)  # where bigfit writes, but no record matches: kept

    @property
    def holds_run(self) -> bool:
        """A run trained here: it left checkpoints, step logs or a model, or links stand where it
        writes (run.json and worker logs alone are a start that failed before its first step)."""
        return bool(self.checkpoints or self.partial or self.logs or self.model or self.links)

    def describe(self) -> str:
        parts = []
        if self.checkpoints:
            parts.append(f"{len(self.checkpoints)} checkpoint(s), newest {self.checkpoints[0].name}")
        parts += [p.name for p in self.logs] + sorted({f"{self.rel(p).split('/')[0]}/" for p in self.model})
        shown = self.checkpoints + self.partial + self.logs + self.model
        parts += [f"the link {self.rel(p)}" for p in self.links if p not in shown]
        started = f"the run {self.run['run_id']}" if self.run and "run_id" in self.run else "a bigfit run"
        return f"{started} ({', '.join(parts) or 'interrupted saves'})"

    def rel(self, p: Path) -> str:
        return p.relative_to(self.root).as_posix()


def inspect(root: Path, exact: bool = False) -> Contents:
    """What `root` holds. `exact`: each recorded file checked by its bytes too (else by its size), as
    before removing it; checks that remove nothing stay cheap."""
    c = Contents(root)
    if not root.is_dir():
        return c
    c.run = _run(root)
    recorded = (c.run or {}).get("paths")
    # only bigfit's own patterns: an edited run.json names nothing else
    paths = set(RUN_PATHS) & {p for p in (recorded if isinstance(recorded, list) else ()) if isinstance(p, str)}
    for name in FOLDERS:
        p = root / name
        if p.is_symlink():
            c.links.append(p)
            if name in ("model", "adapter"):
                c.model.append(p)
        elif p.is_dir() and name == "checkpoints":
            _checkpoints(c, p, paths, exact)
        elif p.is_dir() and name in ("model", "adapter"):
            _model(c, p, exact)
        elif p.is_dir():
            _logs(c, p, paths)
        elif p.exists():
            c.kept.append(p)
    for name in (n for n in RUN_PATHS if "/" not in n):
        p = root / name
        if p.is_symlink():
            c.links.append(p)
        elif p.is_file():
            (c.gone if name in paths else c.kept).append(p)
        if name in LOGS and (p.is_symlink() or p.is_file()):
            c.logs.append(p)
    c.checkpoints.sort(key=step_of, reverse=True)
    c.gone += c.links
    return c


def _run(root: Path) -> dict | None:
    text = records.read(root / RUN_FILE)
    with contextlib.suppress(ValueError):
        run = json.loads(text or "")
        return run if isinstance(run, dict) else None
    return None


def _checkpoints(c: Contents, folder: Path, paths: set[str], exact: bool) -> None:
    for e in sorted(folder.iterdir()):
        link = e.is_symlink()
        real = not link and e.is_dir()
        if NAME.match(e.name) and (link or real):
            c.checkpoints.append(e)
            if real:
                ours, kept = records.split(e, records.checkpoint_record(e), MARKER, exact)
                c.gone, c.kept = c.gone + ours, c.kept + kept
        elif PARTIAL.match(e.name) and (link or real):
            c.partial.append(e)
            if real:  # bigfit's while run.json says its run writes them; a link in one goes as a link either way
                vouched = "checkpoints/.step-*.partial/*" in paths
                for p in records.entries(e):
                    (c.gone if vouched or p.is_symlink() else c.kept).append(p)
        else:
            c.kept += records.entries(e) if real else [e]
            continue
        if link:
            c.links.append(e)


def _model(c: Contents, folder: Path, exact: bool) -> None:
    ours, kept = records.split(folder, records.model_record(folder), MODEL_MARKER, exact)
    c.model, c.gone, c.kept = c.model + ours, c.gone + ours, c.kept + kept


def _logs(c: Contents, folder: Path, paths: set[str]) -> None:
    """logs/ and nvme/: the files of run.json's paths; a link where one goes, or where a folder of them goes."""
    for p in records.entries(folder):
        rel = c.rel(p)
        if p.is_symlink() and any(fits(rel, q) for q in RUN_PATHS + SUBFOLDERS):
            c.links.append(p)
        else:
            (c.gone if any(fits(rel, q) for q in paths) else c.kept).append(p)


def fits(rel: str, pattern: str) -> bool:
    """Relative path `rel` is one `pattern` names (a * stays within one folder)."""
    a, b = PurePosixPath(rel).parts, PurePosixPath(pattern).parts
    return len(a) == len(b) and all(fnmatchcase(x, y) for x, y in zip(a, b))


def remove_run(c: Contents) -> None:
    """Remove `c.gone` (files, and links: a link goes, what it points to stays), then each folder that
    held them once nothing else is left in it; anything no record matches stays where it is."""
    for p in c.gone:
        p.unlink(missing_ok=True)
    held = [p.parent for p in c.gone] + c.checkpoints + c.partial
    folders = {d for p in held for d in (p, *p.parents) if c.root in d.parents}
    for d in sorted(folders, key=lambda d: len(d.parts), reverse=True):  # the deepest first
        with contextlib.suppress(OSError):
            d.rmdir()  # only a real, empty directory: rmdir removes neither a link nor a file


def enclosing(path: Path) -> tuple[Path, str] | None:
    """The checkpoint or model directory `path` is or lies in (a model directory: bigfit's marker, or a
    config and weights), and which of the two; None where there is none."""
    for d in (path, *path.parents):
        if NAME.match(d.name) and ((d / MARKER).exists() or (d / ".metadata").exists()):
            return d, "checkpoint"
        if (d / MODEL_MARKER).is_file() or (((d / "config.json").is_file() or (d / "adapter_config.json").is_file())
                                            and any((d / w).is_file() for w in WEIGHTS)):
            return d, "model directory"
    return None


def check_outside(path: Path, what: str, itself: bool = True) -> None:
    """A BigfitError when `path` is (`itself`) or lies in a checkpoint or model directory: bigfit's files
    would mix with that directory's, and a later --overwrite of either would meet the other's."""
    if found := enclosing(path if itself else path.parent):
        d, kind = found
        where = "is" if d == path else "lies inside"
        raise BigfitError(f"{what} {str(path)!r} {where} the {kind} {str(d)!r}; bigfit's files would mix with its "
                          f"own: give a directory outside it")


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

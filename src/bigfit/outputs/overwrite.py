"""What a claim (ownership.py) may do to the files already in an output directory, and the checks
that come before it touches any: `--overwrite`'s removal, and the run's own later writes.

`replace` removes exactly what rundir.inspect finds that bigfit's records vouch for (checked by
their bytes first), once nothing stands in the way: a kept file where the new run would write
(`in_the_way`: a checkpoint changed since it was saved, metrics.jsonl with no run.json, a
user's config.json where the run's model goes), or an input of the run that lies in or under what
would be removed (`bigfit train --model out/model --output-dir out --overwrite` once deleted the
model, then failed for want of it). Each is one line, before anything is removed.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import BigfitError
from . import rundir
from .ckptdir import NAME
from .records import model_named

SHOWN = 4  # kept files named in a line, then how many more


def slot(job) -> str | None:
    """The directory of OUTPUT the run writes at its end ("model", or a LoRA run's "adapter"); None: none."""
    cfg = job.cfg
    return ("adapter" if job.lora else "model") if cfg.consolidate and cfg.checkpoints else None


def check_way(job, c: rundir.Contents, new_run: bool) -> None:
    """A BigfitError naming the kept files the run would write over (`in_the_way`)."""
    where = slot(job)
    if not (blocked := in_the_way(c, where, new_run)):
        return
    at_end = all(c.rel(p).split("/")[0] == where for p in blocked)
    fix = "move them away, choose another --output-dir" + (", or train with --no-consolidate" if at_end else "")
    raise BigfitError(f"--output-dir {str(c.root)!r} holds {_names(c, blocked)}, which no bigfit record matches "
                      f"(bigfit did not write them, or they changed since), where this run writes"
                      f"{' its model at its end' if at_end else ''}: {fix}")


def in_the_way(c: rundir.Contents, model: str | None, new_run: bool) -> list[Path]:
    """The kept entries a run would write over: with `new_run`, a file where bigfit makes a folder, a
    log's path, anything in a checkpoint or an interrupted save (a save of that step replaces the
    directory whole); with `model` ("model", "adapter": the directory the run writes at its end), a
    file of a model's names there, or a file in its place."""
    def blocks(p: Path) -> bool:
        rel = c.rel(p)
        top, *rest = rel.split("/")
        if top == model:
            return not rest or (len(rest) == 1 and model_named(rest[0]))
        saved = top == "checkpoints" and rest and (NAME.match(rest[0]) or rundir.PARTIAL.match(rest[0]))
        return new_run and ((not rest and top in rundir.FOLDERS) or bool(saved)
                            or any(rundir.fits(rel, q) for q in rundir.RUN_PATHS))
    return [p for p in c.kept if blocks(p)]


def replace(job, out: Path, given: dict[str, str]) -> str:
    """Remove the run in `out` for `job` (--overwrite) and say what went and what was kept; first the
    checks, each a BigfitError before anything is removed."""
    c = rundir.inspect(out, exact=True)  # by the files' bytes: a file changed since it was written is kept
    check_way(job, c, new_run=True)
    for flag, value, holds in _inputs(job, given):
        if hit := _hit(value, c.gone, holds):
            raise BigfitError(f"{flag} {value!r} lies in what --overwrite would remove from --output-dir "
                              f"{str(out)!r} ({'the link ' if hit.is_symlink() else ''}{c.rel(hit)}); copy it out of "
                              "there first, or choose another --output-dir")
    rundir.remove_run(c)
    line = f"removed {c.describe()} from {out} (--overwrite)"
    if c.links:
        line += f"; links removed as links, what they point to untouched: {_names(c, c.links)}"
    if c.kept:
        line += f"; kept, as no bigfit record matches them: {_names(c, c.kept)}"
    return line


def _names(c: rundir.Contents, paths: list[Path]) -> str:
    shown = ", ".join(c.rel(p) for p in paths[:SHOWN])
    return shown + (f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else "")


def _inputs(job, given: dict[str, str]) -> list[tuple[str, str, bool]]:
    """(flag, path, holds) for each input of the run that is a path here; `holds`: files under it are
    the input's (not for --nvme-dir, where the run's own state files are bigfit's to replace)."""
    cfg = job.cfg
    found = [("--model", cfg.model, True), ("--data", cfg.data, True), ("--chat-template", cfg.chat_template, True),
             ("--device-map", cfg.device_map if cfg.device_map != "auto" else None, True),
             ("--resume", str(job.resume_from) if job.resume_from else None, True), ("--nvme-dir", cfg.nvme_dir, False),
             *((flag, value, True) for flag, value in given.items())]
    return [(f, v, h) for f, v, h in found if v and os.path.lexists(os.path.expanduser(v))]


def _hit(value: str, gone: list[Path], holds: bool) -> Path | None:
    """A removed file or link that the path `value` is, passes through, or (`holds`) holds."""
    passed, end = _reach(value)
    return next((r for r in gone if r in passed or r == end or (holds and end in r.parents)), None)


def _reach(value: str) -> tuple[set[Path], Path]:
    """The places the path `value` passes through (each of its components, with the links before it
    followed, and their folders) and where it ends: a link on the way counts as passed."""
    p = Path(os.path.abspath(os.path.expanduser(value)))
    here, passed = Path(p.anchor), set()
    for part in p.parts[1:]:
        here = Path(os.path.realpath(here)) / part
        passed |= {here, *here.parents}
    return passed, Path(os.path.realpath(p))

"""A checkpoint save that some rank cannot write: every rank learns it, its `.partial` goes, and a
full disk is one line naming the checkpoint, the room it needs and the room there is.

A full disk reaches the save as an OSError (ENOSPC, EDQUOT: Python's writes, DCP's writer) or as
torch's zip writer cut short: torch.save to a path ends "unexpected pos 704 vs 598" when fwrite
writes less than asked, inside DCP's writer as well (torch 2.13, a 64 KiB tmpfs, 2026-12-07).
Every rank runs the save's steps in the same order; a step's local failure is caught and the ranks
agree on whether any failed (`attempt`: one all-reduce, the barrier the step needed anyway) before
the next collective, so no rank waits in a barrier for one that gave up. DCP's own save fails on
every rank alike: its CheckpointException carries each rank's failure.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Callable, NoReturn

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..common.distributed import Runtime, all_reduce_sum, broadcast_object, gather_objects
from ..errors import BigfitError
from ..outputs import manifest
from ..outputs.ckptdir import MARKER, steps

CUT_SHORT = re.compile(r"unexpected pos|file write failed|PytorchStreamWriter failed")  # torch's zip writer
# DCP torch.saves each tensor piece: 1.55-1.58 KB of zip records beside its data, and .metadata ~0.3 KB
# for it (the tiny T5's 243 pieces: 943 KB of tensors in 1.41 MB of files, torch 2.13)
PIECE_BYTES = 2 << 10


class OtherRankFailed(Exception):
    """This rank wrote its part; another rank did not."""


def attempt(step: Callable[[], None], rt: Runtime) -> BaseException | None:
    """Run `step` on this rank, then agree with every rank: None where all succeeded, else this
    rank's failure (`Elsewhere` where it was another rank's). Ctrl-C is not caught: it ends the job."""
    try:
        step()
        error = None
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        error = e
    if all_reduce_sum([float(error is not None)], rt)[0] and error is None:
        error = OtherRankFailed()
    return error


def disk_reason(error: BaseException) -> str | None:
    """Why a write failed where the file system refused it (full, over quota, I/O), else None."""
    if isinstance(error, CheckpointException):
        return next((r for f in error.failures.values() if (r := disk_reason(f[0]))), None)
    if isinstance(error, OSError):
        return error.strerror or str(error)
    if isinstance(error, RuntimeError) and CUT_SHORT.search(str(error)):
        return f"a write was cut short: {str(error).splitlines()[0]}"
    return None


def abandon(tmp: Path, final: Path, state: dict, error: BaseException, rt: Runtime) -> NoReturn:
    """Collective, once `attempt` failed somewhere: rank 0 removes `tmp`, then every rank raises a
    BigfitError saying the room `final` needs where any rank's failure was the disk's; else each
    rank its own failure (a bug keeps its traceback)."""
    parts = gather_objects((disk_reason(error), tensor_bytes(state)), rt)
    verdict = None
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        if reasons := [r for r, _ in parts if r]:
            need = sum({k: n for _, sizes in parts for k, n in sizes.items()}.values())  # replicas written once
            verdict = room_message(final, reasons[0], max(need, previous_bytes(final.parent)))
    verdict = broadcast_object(verdict, rt)
    if verdict:
        raise BigfitError(verdict)
    if isinstance(error, OtherRankFailed):
        raise RuntimeError(f"checkpoint {str(final)!r}: another rank could not write its part (its log says why)")
    raise error


def room_message(final: Path, reason: str, need: int) -> str:
    where = next(p for p in [final.parent, *final.parents] if p.exists())
    free = shutil.disk_usage(where).free
    then = ("the earlier checkpoints are intact: make room (or keep fewer, --keep-checkpoints N), then continue "
            "with --resume latest") if steps(final.parent) else "make room, then run it again"
    return (f"checkpoint {str(final)!r} could not be written ({reason}): it needs about {size_text(need)} and "
            f"{size_text(free)} is free in {str(where)!r}; its .partial is removed, {then}")


def previous_bytes(root: Path) -> int:
    """The bytes of the newest checkpoint in `root` whose manifest can be read (0: none): this
    run's layout writes about as much again, its tokenizer and config included."""
    for ckpt in steps(root):
        try:
            body = manifest.unseal((ckpt / MARKER).read_text())
        except OSError:
            continue
        if body and manifest.well_formed(body.get("files")):
            return sum(size for size, _ in body["files"].values())
    return 0


def tensor_bytes(state: dict) -> dict[str, int]:
    """Each tensor of a checkpoint's state by its key, whole (a DTensor's global shape), with DCP's
    records for each piece written: the bytes DCP writes for it, once however many ranks hold a copy."""
    out: dict[str, int] = {}

    def walk(obj, key: str) -> None:
        if isinstance(obj, torch.Tensor):
            pieces = obj.device_mesh.size() if hasattr(obj, "device_mesh") else 1  # a DTensor: one per rank at most
            out[key] = obj.shape.numel() * obj.dtype.itemsize + pieces * PIECE_BYTES
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}.{i}")

    walk(state, "")
    return out


def size_text(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"

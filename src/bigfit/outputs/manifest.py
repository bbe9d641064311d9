"""Checkpoint manifests: the size and CRC-32 of every file of a checkpoint, written into its
COMPLETE marker, so that a truncated shard, a flipped byte or a missing file is found before
anything is loaded (DCP itself would fail deep inside a load with a traceback that names neither
the checkpoint nor the file).

CRC-32 rather than a cryptographic hash: it only has to catch damage, not an adversary (who re-seals
a crafted file's marker: safeload.py reads every file as data, which is the defence), and zlib's
runs at 2.8 GB/s on one core of the CPU machine against sha256's 1.3 (2026-12-01, 256 MiB buffer).
zlib releases the GIL on large buffers, so every 256 MiB piece of a file gets its own CRC and the
pieces are checksummed on several threads at once; at save time every rank checksums the files
it wrote.
"""
from __future__ import annotations

import json
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..common.distributed import cores_per_rank

CHUNK = 16 << 20  # bytes read at a time: large enough for zlib to run at full speed without the GIL
PIECE = 256 << 20  # one CRC per piece, so that one large shard is checksummed on several threads
OWNED = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank-(\d+)\.pt)$")  # DCP's data files and bigfit's RNG files


def _crc(path: Path, offset: int) -> int:
    value, left = 0, PIECE
    with open(path, "rb") as f:
        f.seek(offset)
        while left and (block := f.read(min(CHUNK, left))):
            value, left = zlib.crc32(block, value), left - len(block)
    return value


def file_list(directory: Path, exclude: str) -> list[str]:
    """Every file under `directory` (relative names, sorted), except the marker `exclude`."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != exclude)


def written_by(names: list[str], rank: int) -> list[str]:
    """The files rank `rank` wrote: DCP names each rank's data files __RANK_N.distcp and bigfit its
    RNG files rank-RANK.pt; rank 0 wrote everything else (.metadata, trainer.json, config, tokenizer).
    Each rank checksums its own files: the sizes it sees are final even on a network file system."""
    def owner(name: str) -> int:
        m = OWNED.match(name)
        return int(m.group(1) or m.group(2)) if m else 0
    return [n for n in names if owner(n) == rank]


def describe(directory: Path, names: list[str]) -> dict[str, list]:
    """{name: [size, [CRC-32 of each piece]]} for `names` under `directory`, one piece per task on
    this rank's share of the cores."""
    sizes = {n: (directory / n).stat().st_size for n in names}
    tasks = [(n, off) for n in names for off in range(0, max(sizes[n], 1), PIECE)]
    with ThreadPoolExecutor(max(1, min(len(tasks), cores_per_rank()))) as pool:
        crcs = list(pool.map(lambda t: _crc(directory / t[0], t[1]), tasks))
    out = {n: [sizes[n], []] for n in names}
    for (n, _), c in zip(tasks, crcs):
        out[n][1].append(c)
    return out


def seal(body: dict) -> str:
    """The marker's text: `body` plus a CRC of itself, so that damage to the marker is found too."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({**body, "crc32": zlib.crc32(text.encode())}, sort_keys=True, separators=(",", ":"))


def unseal(text: str) -> dict | None:
    """The marker's body, or None when it is not one `seal` wrote intact. Markers of checkpoints
    written before manifests existed have no crc32 and no file list: they are returned as they are,
    and refused by ckptdir.damage (nothing in such a checkpoint can be verified)."""
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    if "crc32" not in body:
        return body if "files" not in body else None
    crc = body.pop("crc32")
    return body if zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()) == crc else None


def well_formed(files) -> bool:
    """`files` is a manifest `seal` could have written: {a name inside the checkpoint: [size, [CRC-32
    of each piece]]}, so that checking it reads nothing outside the checkpoint."""
    def name_ok(n) -> bool:
        return isinstance(n, str) and bool(n) and not Path(n).is_absolute() and ".." not in Path(n).parts

    def entry_ok(v) -> bool:
        return (isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], list)
                and all(isinstance(c, int) for c in v[1]))
    return isinstance(files, dict) and all(name_ok(n) and entry_ok(v) for n, v in files.items())


def first_problem(directory: Path, files: dict[str, list], marker: str) -> str | None:
    """What is wrong with the files `files` lists (missing, another size, other bytes), or with a
    file of `directory` it does not list (added since), or None."""
    if extra := sorted(set(file_list(directory, marker)) - set(files)):
        return f"{extra[0]} is not in its manifest (added after the checkpoint was written)"
    for name, (size, _) in files.items():
        p = directory / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} has {p.stat().st_size} bytes, {size} were written"
    found = describe(directory, list(files))
    for name, (_, crcs) in files.items():
        if found[name][1] != crcs:
            return f"{name} does not hold the bytes that were written (its CRC-32 differs)"
    return None

"""What identifies data by its content: a file's sha256, or the examples' of data that is no single
file (a dataset directory, a hub dataset). The run's identity (outputs/runinfo.py) and the tokenized
cache's entry names (cache.py) use the same digests."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


def examples_sha256(examples: list[dict]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps(e, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def examples_digest(path: str, examples) -> str | None:
    """The run's identity of --data besides its path: None for one file (runinfo hashes the file's
    bytes), else the examples' sha256. The in-memory and the cached paths both use this rule."""
    return None if Path(path).expanduser().is_file() else examples_sha256(examples)

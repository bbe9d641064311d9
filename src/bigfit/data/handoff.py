"""The tokenized data a job's starter hands to its workers, so that no worker reads or tokenizes
--data again: the training samples as flat columns (arrays.Lists: offsets and values) in .npy files
that every rank of the node memory-maps (the kernel keeps one copy of their pages), the held-out
samples as JSON. A cache entry (cache.py) is handed over as itself.

Measured on the CPU machine (benchmarks/startup_cost.py, 2 ranks, 30 MB JSONL, embedded T5): each
worker used to read and tokenize the file again and hold its samples as Python lists, beside the
launcher, which had already done so for its checks. numpy alone: no extra is needed, unlike the
Arrow cache, whose library (datasets) is optional.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from .arrays import FlatSamples, Lists
from .tokenize import Dataset, pad_id

COLUMNS = ("input_ids", "labels", "parts")  # what training reads of a sample (batches.py)


def write(dataset: Dataset, where: Path) -> Path:
    """The directory the workers map `dataset` from: `where`, written whole (aside, then renamed),
    or the cache entry the dataset already is."""
    if dataset.cached:
        return Path(dataset.cached)
    tmp = where.with_name(f"{where.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    train = dataset.train
    names = [c for c in COLUMNS if len(train) and c in train[0]]
    for name in names:
        rows = [train[i][name] for i in range(len(train))]
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        np.save(tmp / f"{name}.offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        np.save(tmp / f"{name}.values.npy", np.fromiter((v for r in rows for v in r), dtype=np.int32,
                                                        count=int(lengths.sum())))
    meta = {"rows": len(train), "columns": names, "eval": dataset.eval, "packed": dataset.packed}
    (tmp / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(where, ignore_errors=True)
    os.replace(tmp, where)
    return where


def read(where: Path, tokenizer) -> Dataset:
    """The dataset the starter left in `where` (this module's files, or a cache entry), memory-mapped."""
    meta = json.loads((where / "meta.json").read_text())
    if (where / "train.arrow").exists():  # a cache entry
        from .arrays import ArrowSamples

        return Dataset(train=ArrowSamples(where / "train.arrow"), eval=meta["eval"], pad_id=pad_id(tokenizer),
                       packed=meta["packed"], cached=str(where))
    return Dataset(train=NpySamples(where, meta), eval=meta["eval"], pad_id=pad_id(tokenizer), packed=meta["packed"])


class NpySamples(FlatSamples):
    """Training samples mapped from this module's .npy files."""

    def __init__(self, where: Path, meta: dict):
        super().__init__({name: Lists(np.load(where / f"{name}.offsets.npy", mmap_mode="r"),
                                      np.load(where / f"{name}.values.npy", mmap_mode="r"))
                          for name in meta["columns"]}, meta["rows"])

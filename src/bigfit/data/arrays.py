"""Token lists as flat arrays (offsets + values, Arrow's own list layout), for data too large to hold
as Python lists: what cache.py builds with, writes and maps. Each function is the numpy form of one
step of tokenize.build_dataset, which tests hold equal to it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .pack import bounds
from .tokenize import IGNORE


@dataclass
class Lists:
    """Row i is values[offsets[i]:offsets[i + 1]]."""

    offsets: np.ndarray  # int64, rows + 1, from 0
    values: np.ndarray  # int32

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row(self, i: int) -> list[int]:
        return self.values[self.offsets[i]:self.offsets[i + 1]].tolist()


def lists_of(column) -> Lists:
    """A list column of a pyarrow table (chunked, possibly sliced) as Lists."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    return Lists(np.concatenate([[0], np.cumsum(lengths)]), values)


def blocks(docs: Lists, block: int, per_document: bool) -> Lists:
    """Running text cut into blocks of `block` tokens: the documents run together, the last partial
    block dropped; or `per_document`: each document's blocks, its last one shorter (tokenize._text_blocks)."""
    if not per_document:
        n = len(docs.values) // block
        return Lists(np.arange(n + 1, dtype=np.int64) * block, docs.values[:n * block])
    lengths = docs.lengths
    count = -(-lengths // block)  # blocks per document; an empty document has none
    first = np.repeat(docs.offsets[:-1], count)
    within = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    return Lists(np.concatenate([first + within * block, [len(docs.values)]]).astype(np.int64), docs.values)


def drop_rows(rows: Lists, drop: list[int]) -> Lists:
    """Every row but `drop` (the held-out few), in order."""
    if not drop:
        return rows
    keep = np.ones(len(rows.values), dtype=bool)
    for i in drop:
        keep[rows.offsets[i]:rows.offsets[i + 1]] = False
    lengths = np.delete(rows.lengths, np.asarray(drop, dtype=np.int64))
    return Lists(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), rows.values[keep])


def pack_columns(ids: Lists, labels: Lists, length: int) -> dict[str, Lists]:
    """pack.pack on flat arrays: the samples stay where they are and the sequences' offsets skip to
    each pack's first sample; no part's first label is a target."""
    edges = np.asarray(bounds(ids.lengths.tolist(), length), dtype=np.int64)
    learn = labels.values.copy()
    starts = ids.offsets[:-1][ids.lengths > 0]
    learn[starts] = IGNORE
    return {"input_ids": Lists(ids.offsets[edges], ids.values), "labels": Lists(ids.offsets[edges], learn),
            "parts": Lists(edges, ids.lengths.astype(np.int32))}


def write(path: Path, columns: dict[str, Lists]) -> int:
    """An Arrow IPC file of one record batch (64-bit offsets: corpora past 2**31 tokens); returns its rows."""
    import pyarrow as pa

    arrays = {k: pa.LargeListArray.from_arrays(pa.array(c.offsets), pa.array(c.values)) for k, c in columns.items()}
    batch = pa.record_batch(list(arrays.values()), names=list(arrays))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return batch.num_rows


class FlatSamples(Sequence):
    """Training samples held as flat columns (`Lists`, memory-mapped by the subclasses): indexed as the
    list of sample dicts tokenize.py makes, each row turned into Python lists only when asked for."""

    def __init__(self, columns: dict[str, Lists], rows: int):
        self._columns, self._rows = columns, rows

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, i: int) -> dict:
        if not -self._rows <= i < self._rows:
            raise IndexError(i)
        return {name: c.row(i % self._rows) for name, c in self._columns.items()}

    def lengths(self) -> np.ndarray:
        """input_ids plus labels tokens of each sample (micro-batch auto's probe takes the longest)."""
        return self._columns["input_ids"].lengths + self._columns["labels"].lengths


class ArrowSamples(FlatSamples):
    """Training samples read from a memory-mapped Arrow file (a cache entry's, cache.py)."""

    def __init__(self, path: Path):
        import pyarrow as pa

        batch = pa.ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0)
        super().__init__({name: Lists(batch.column(name).offsets.to_numpy(), batch.column(name).values.to_numpy())
                          for name in batch.schema.names}, batch.num_rows)


class Reordered(Sequence):
    """`samples` in the order `order`, each read when asked for (a slice: a list)."""

    def __init__(self, samples: Sequence[dict], order: np.ndarray):
        self.samples, self.order = samples, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.samples[int(j)] for j in self.order[i]]
        return self.samples[int(self.order[i])]


def first(samples: Sequence[dict], n: int) -> Sequence[dict]:
    """The first n samples (--max-train-samples): a list's slice, or a view of memory-mapped ones."""
    return samples[:n] if isinstance(samples, list) else Reordered(samples, np.arange(n))


def longest(samples: Sequence[dict]) -> tuple[int, int]:
    """The most input_ids and the most labels tokens of any sample (0, 0 for none)."""
    if isinstance(samples, FlatSamples):
        return tuple(int(samples._columns[k].lengths.max(initial=0)) for k in ("input_ids", "labels"))
    return (max((len(s["input_ids"]) for s in samples), default=0), max((len(s["labels"]) for s in samples), default=0))


def longest_first(samples: Sequence[dict]) -> Reordered:
    """The samples by input_ids plus labels tokens, longest first, ties in their order."""
    if isinstance(samples, FlatSamples):
        lengths = samples.lengths()
    else:
        lengths = np.array([len(s["input_ids"]) + len(s["labels"]) for s in samples])
    return Reordered(samples, np.argsort(-lengths, kind="stable"))

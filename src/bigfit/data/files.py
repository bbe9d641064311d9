"""Reading user data, with errors that name the file, the line and what would be valid.

- JSONL: one object per line with "source" and "target" strings (translation, instruction tuning),
  "prompt" and "completion", a "text" string (causal language modelling) or "messages" (chat.py);
  or the columns --data-columns names (columns.py).
- CSV: a header row with those columns.
- a saved dataset directory, parquet or arrow files, a hub dataset name: tables.py.
- anything else (.txt, .md, ...): plain text for causal language modelling, one document per file.

Every file is decoded strictly as --data-encoding (utf-8 by default): a byte that does not decode is an
error naming the line and offset, never a replacement character trained on.
"""
from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

from ..errors import BigfitError
from ..settings.userfiles import check_encoding, reading, user_file
from .columns import Columns
from .tables import is_table, read_table

KINDS = "a JSONL, CSV, text, parquet or arrow file, a saved dataset directory or a hub dataset name"
ENCODING_HINT = "if the file is in another encoding, name it with --data-encoding (e.g. --data-encoding latin-1)"


def read_examples(path: str, encoding: str = "utf-8", columns: str | None = None, split: str = "train",
                  config: str | None = None) -> list[dict]:
    """The examples --data holds: {"source", "target"}, {"text"} or {"messages"} dicts. `columns`: --data-columns;
    `split` and `config`: --data-split and --data-config, for datasets (tables.py)."""
    return list(iter_examples(path, encoding, columns, split, config))


def iter_examples(path: str, encoding: str = "utf-8", columns: str | None = None, split: str = "train",
                  config: str | None = None) -> Iterator[dict]:
    """read_examples' records one at a time, each checked as it is read (JSONL, CSV and tables are read
    as they go: the tokenized cache's builder holds no list of them, cache.py)."""
    check_encoding(encoding)
    what, cols = f"--data {path!r}", Columns.parse(columns)
    rows = _read_rows(read_table(path, split, config), cols, what) if is_table(path) else _read_file(path, encoding, cols, what)
    first = None
    for e in rows:
        kind = next(iter(e)) if len(e) == 1 else "source/target"
        first = first or kind
        if kind != first:
            raise BigfitError(f"{what} mixes {' and '.join(repr(k) for k in sorted((first, kind)))} records; use one kind")
        yield e
    if first is None:
        raise BigfitError(f"{what} holds no examples")


def _read_file(path: str, encoding: str, cols: Columns, what: str) -> Iterator[dict]:
    p = user_file(path, what, KINDS)
    if p.stat().st_size == 0:
        raise BigfitError(f"{what} is empty; give a file of examples")
    with reading(p, what, encoding, ENCODING_HINT):
        if p.suffix == ".jsonl":
            yield from _read_jsonl(p, encoding, cols)
        elif p.suffix == ".csv":
            yield from _read_csv(p, encoding, cols)
        elif (text := p.read_text(encoding=encoding)).strip():
            yield {"text": text}


def _read_rows(table, cols: Columns, what: str) -> Iterator[dict]:
    """A datasets.Dataset's rows as examples; only the columns read are decoded."""
    keep = [c for c in cols.names() if c in table.column_names]
    if not keep:
        raise BigfitError(f"{what} has the columns {table.column_names}, none of {cols.names()}; name them with "
                          "--data-columns (e.g. source=translation.en,target=translation.ro or text=content)")
    return (cols.record(row, f"{what} row {n}") for n, row in enumerate(table.select_columns(keep)))


def _read_jsonl(p: Path, encoding: str, cols: Columns) -> Iterator[dict]:
    with p.open(encoding=encoding) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BigfitError(f"--data {str(p)!r} line {n} is not valid JSON ({e.msg}, column {e.colno})") from None
            yield cols.record(obj, f"--data {str(p)!r} line {n}")


def _read_csv(p: Path, encoding: str, cols: Columns) -> Iterator[dict]:
    with p.open(encoding=encoding, newline="") as f:
        reader = csv.DictReader(f)
        try:
            header = reader.fieldnames or []
            if not set(cols.names()) & set(header):
                raise BigfitError(f"--data {str(p)!r}: the header row {header} has none of the columns {cols.names()}; "
                                  "name them with --data-columns (e.g. source=en,target=ro)")
            # line numbers count the header as line 1
            for n, row in enumerate(reader, 2):
                yield cols.record(row, f"--data {str(p)!r} line {n}")
        except csv.Error as e:  # a NUL byte, a field over csv's size limit, a quote left open at the end
            line = reader.reader.line_num  # DictReader's own line_num is the last good row's
            raise BigfitError(f"--data {str(p)!r} line {line}: not readable as CSV ({e})") from None

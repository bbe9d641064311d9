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
from pathlib import Path

from ..errors import BigfitError
from ..userfiles import check_encoding, reading, user_file
from .columns import Columns
from .tables import is_table, read_table

KINDS = "a JSONL, CSV, text, parquet or arrow file, a saved dataset directory or a hub dataset name"
ENCODING_HINT = "if the file is in another encoding, name it with --data-encoding (e.g. --data-encoding latin-1)"


def read_examples(path: str, encoding: str = "utf-8", columns: str | None = None, split: str = "train",
                  config: str | None = None) -> list[dict]:
    """The examples --data holds: {"source", "target"}, {"text"} or {"messages"} dicts. `columns`: --data-columns;
    `split` and `config`: --data-split and --data-config, for datasets (tables.py)."""
    check_encoding(encoding)
    what, cols = f"--data {path!r}", Columns.parse(columns)
    if is_table(path):
        examples = _read_rows(read_table(path, split, config), cols, what)
    else:
        examples = _read_file(path, encoding, cols, what)
    if not examples:
        raise BigfitError(f"{what} holds no examples")
    kinds = {next(iter(e)) if len(e) == 1 else "source/target" for e in examples}
    if len(kinds) > 1:
        raise BigfitError(f"{what} mixes {' and '.join(repr(k) for k in sorted(kinds))} records; use one kind")
    return examples


def _read_file(path: str, encoding: str, cols: Columns, what: str) -> list[dict]:
    p = user_file(path, what, KINDS)
    if p.stat().st_size == 0:
        raise BigfitError(f"{what} is empty; give a file of examples")
    with reading(p, what, encoding, ENCODING_HINT):
        if p.suffix == ".jsonl":
            return _read_jsonl(p, encoding, cols)
        if p.suffix == ".csv":
            return _read_csv(p, encoding, cols)
        text = p.read_text(encoding=encoding)
        return [{"text": text}] if text.strip() else []


def _read_rows(table, cols: Columns, what: str) -> list[dict]:
    """A datasets.Dataset's rows as examples; only the columns read are decoded."""
    keep = [c for c in cols.names() if c in table.column_names]
    if not keep:
        raise BigfitError(f"{what} has the columns {table.column_names}, none of {cols.names()}; name them with "
                          "--data-columns (e.g. source=translation.en,target=translation.ro or text=content)")
    return [cols.record(row, f"{what} row {n}") for n, row in enumerate(table.select_columns(keep))]


def _read_jsonl(p: Path, encoding: str, cols: Columns) -> list[dict]:
    out = []
    with p.open(encoding=encoding) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BigfitError(f"--data {str(p)!r} line {n} is not valid JSON ({e.msg}, column {e.colno})") from None
            out.append(cols.record(obj, f"--data {str(p)!r} line {n}"))
    return out


def _read_csv(p: Path, encoding: str, cols: Columns) -> list[dict]:
    with p.open(encoding=encoding, newline="") as f:
        reader = csv.DictReader(f)
        try:
            header = reader.fieldnames or []
            if not set(cols.names()) & set(header):
                raise BigfitError(f"--data {str(p)!r}: the header row {header} has none of the columns {cols.names()}; "
                                  "name them with --data-columns (e.g. source=en,target=ro)")
            # line numbers count the header as line 1
            return [cols.record(row, f"--data {str(p)!r} line {n}") for n, row in enumerate(reader, 2)]
        except csv.Error as e:  # a NUL byte, a field over csv's size limit, a quote left open at the end
            line = reader.reader.line_num  # DictReader's own line_num is the last good row's
            raise BigfitError(f"--data {str(p)!r} line {line}: not readable as CSV ({e})") from None

"""Reading user data files, with errors that name the file, the line and what would be valid.

- JSONL: one object per line with "source" and "target" strings (translation, instruction tuning)
  or a "text" string (causal language modelling).
- CSV: a header row with source,target columns, or a text column.
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

FIELDS_HELP = "each record needs 'source' and 'target' strings, or a 'text' string"
KINDS = "a JSONL, CSV or text file"
ENCODING_HINT = "if the file is in another encoding, name it with --data-encoding (e.g. --data-encoding latin-1)"


def read_examples(path: str, encoding: str = "utf-8") -> list[dict]:
    check_encoding(encoding)
    what = f"--data {path!r}"
    p = user_file(path, what, KINDS)
    if p.stat().st_size == 0:
        raise BigfitError(f"{what} is empty; give {KINDS} of examples")
    with reading(p, what, encoding, ENCODING_HINT):
        if p.suffix == ".jsonl":
            examples = _read_jsonl(p, encoding)
        elif p.suffix == ".csv":
            examples = _read_csv(p, encoding)
        else:
            text = p.read_text(encoding=encoding)
            examples = [{"text": text}] if text.strip() else []
    if not examples:
        raise BigfitError(f"{what} holds no examples")
    kinds = {"text" if "text" in e else "pair" for e in examples}
    if len(kinds) > 1:
        raise BigfitError(f"{what} mixes 'text' records with 'source'/'target' records; use one kind")
    return examples


def _record(obj, where: str) -> dict:
    if isinstance(obj, dict):
        if isinstance(obj.get("source"), str) and isinstance(obj.get("target"), str):
            return {"source": obj["source"], "target": obj["target"]}
        if isinstance(obj.get("text"), str):
            return {"text": obj["text"]}
    raise BigfitError(f"{where}: {FIELDS_HELP}; got {str(obj)[:80]!r}")


def _read_jsonl(p: Path, encoding: str) -> list[dict]:
    out = []
    with p.open(encoding=encoding) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BigfitError(f"--data {str(p)!r} line {n} is not valid JSON ({e.msg}, column {e.colno})") from None
            out.append(_record(obj, f"--data {str(p)!r} line {n}"))
    return out


def _read_csv(p: Path, encoding: str) -> list[dict]:
    with p.open(encoding=encoding, newline="") as f:
        reader = csv.DictReader(f)
        try:
            cols = reader.fieldnames or []
            if not ({"source", "target"} <= set(cols) or "text" in cols):
                raise BigfitError(f"--data {str(p)!r}: the header row {cols} needs source,target or text columns")
            # line numbers count the header as line 1
            return [_record(row, f"--data {str(p)!r} line {n}") for n, row in enumerate(reader, 2)]
        except csv.Error as e:  # a NUL byte, a field over csv's size limit, a quote left open at the end
            line = reader.reader.line_num  # DictReader's own line_num is the last good row's
            raise BigfitError(f"--data {str(p)!r} line {line}: not readable as CSV ({e})") from None

"""Reading user data files, with errors that name the file, the line and what would be valid.

- JSONL: one object per line with "source" and "target" strings (translation, instruction tuning)
  or a "text" string (causal language modelling).
- CSV: a header row with source,target columns, or a text column.
- anything else (.txt, .md, ...): plain text for causal language modelling, one document per file.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

from ..errors import BigfitError

FIELDS_HELP = "each record needs 'source' and 'target' strings, or a 'text' string"


def read_examples(path: str) -> list[dict]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise BigfitError(f"--data {path!r} does not exist or is not a file")
    if p.suffix == ".jsonl":
        examples = _read_jsonl(p)
    elif p.suffix == ".csv":
        examples = _read_csv(p)
    else:
        text = p.read_text(encoding="utf-8", errors="replace")
        examples = [{"text": text}] if text.strip() else []
    if not examples:
        raise BigfitError(f"--data {path!r} holds no examples")
    kinds = {"text" if "text" in e else "pair" for e in examples}
    if len(kinds) > 1:
        raise BigfitError(f"--data {path!r} mixes 'text' records with 'source'/'target' records; use one kind")
    return examples


def _record(obj, where: str) -> dict:
    if isinstance(obj, dict):
        if isinstance(obj.get("source"), str) and isinstance(obj.get("target"), str):
            return {"source": obj["source"], "target": obj["target"]}
        if isinstance(obj.get("text"), str):
            return {"text": obj["text"]}
    raise BigfitError(f"{where}: {FIELDS_HELP}; got {str(obj)[:80]!r}")


def _read_jsonl(p: Path) -> list[dict]:
    out = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BigfitError(f"--data {str(p)!r} line {n} is not valid JSON ({e.msg}, column {e.colno})") from None
            out.append(_record(obj, f"--data {str(p)!r} line {n}"))
    return out


def _read_csv(p: Path) -> list[dict]:
    with p.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        if not ({"source", "target"} <= set(cols) or "text" in cols):
            raise BigfitError(f"--data {str(p)!r}: the header row {cols} needs source,target or text columns")
        # line numbers count the header as line 1
        return [_record(row, f"--data {str(p)!r} line {n}") for n, row in enumerate(reader, 2)]

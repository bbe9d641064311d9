"""Which fields of a record are the source, the target, the running text or the conversation
(`--data-columns`).

Without the flag a record gives `source` and `target` strings, or `prompt` and `completion` (TRL's
prompt-completion format, the same pair for a decoder-only model: the prompt is masked out of the
loss), or a `text` string, or `messages` (a conversation: chat.py). With it, each field names a
column, dotted for nested records:
`--data-columns source=translation.en,target=translation.ro` reads the seed discussion's wmt_en_ro
records ({"translation": {"en": ..., "ro": ...}}); `--data-columns text=content` a text corpus.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import BigfitError
from .chat import checked_messages

FIELDS = ("source", "target", "text", "messages")
ALIASES = {"prompt": "source", "completion": "target"}
FORMAT = ("source=COLUMN,target=COLUMN, text=COLUMN or messages=COLUMN (dotted for nested fields: "
          "source=translation.en)")
# what a record may hold when no --data-columns is given, in the order tried
DEFAULTS = ({"source": "source", "target": "target"}, {"source": "prompt", "target": "completion"}, {"text": "text"},
            {"messages": "messages"})
FIELDS_HELP = ("each record needs 'source' and 'target' strings, 'prompt' and 'completion', a 'text' string or "
               f"'messages' turns (or name its columns with --data-columns {FORMAT})")


@dataclass(frozen=True)
class Columns:
    """(field, the dotted path of its column) for "source" and "target", "text" or "messages";
    None: the DEFAULTS."""
    given: tuple[tuple[str, str], ...] | None = None

    @classmethod
    def parse(cls, spec: str | None) -> "Columns":
        if not spec:
            return cls()
        pairs = {}
        for part in spec.split(","):
            field, sep, path = (x.strip() for x in part.partition("="))
            field = ALIASES.get(field, field)
            if not sep or not path or field not in FIELDS:
                raise BigfitError(f"--data-columns {spec!r}: {part.strip()!r} is not FIELD=COLUMN with FIELD one of "
                                  f"source, target (or prompt, completion), text, messages; give {FORMAT}")
            if field in pairs:
                raise BigfitError(f"--data-columns {spec!r} names {field} twice")
            pairs[field] = path
        if set(pairs) not in ({"source", "target"}, {"text"}, {"messages"}):
            raise BigfitError(f"--data-columns {spec!r} names {sorted(pairs)}; give both source and target, or "
                              f"text or messages alone: {FORMAT}")
        return cls(tuple(sorted(pairs.items())))

    def record(self, obj, where: str) -> dict:
        """The example a record gives ({"source", "target"}, {"text"} or {"messages"}), or one line naming it."""
        if not isinstance(obj, dict):
            raise BigfitError(f"{where}: a record is an object of fields; got {str(obj)[:80]!r}")
        if self.given is None:
            for fields in DEFAULTS:
                values = {f: obj.get(col) for f, col in fields.items()}
                if "messages" in values and values["messages"] is not None:
                    return {"messages": checked_messages(values["messages"], where)}
                if all(isinstance(v, str) for v in values.values()):
                    return values
            raise BigfitError(f"{where}: {FIELDS_HELP}; got {str(obj)[:80]!r}")
        return {f: _column(obj, path, where, f == "messages") for f, path in self.given}

    def names(self) -> list[str]:
        """The top-level columns this mapping reads (None: any of the defaults')."""
        if self.given is None:
            return sorted({c for fields in DEFAULTS for c in fields.values()})
        return sorted({path.split(".")[0] for _, path in self.given})


def _column(obj: dict, path: str, where: str, turns: bool = False):
    value = obj
    for i, key in enumerate(path.split(".")):
        if not isinstance(value, dict) or key not in value:
            at = ".".join(path.split(".")[:i]) or "the record"
            keys = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise BigfitError(f"{where}: --data-columns names {path!r}, but {at} has no {key!r} (it has {keys})")
        value = value[key]
    if turns:
        return checked_messages(value, where)
    if not isinstance(value, str):
        raise BigfitError(f"{where}: column {path!r} is {type(value).__name__}, not a string: {str(value)[:60]!r}")
    return value

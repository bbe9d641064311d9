"""Reading settings as the user writes them: config-file keys (dashes or underscores), each value
checked against its TrainConfig field's annotated type (bool, int, float, str, "auto" where a field
takes it), unknown keys with the closest known one. config.py holds the settings themselves; this
module sits above it (config.py never imports it)."""
from __future__ import annotations

import difflib
import json
import math
import typing
from pathlib import Path

from .config import AUTO, PLANNED, TrainConfig
from .errors import BigfitError
from .userfiles import read_text


def normalise(values: dict, where: str) -> dict:
    """Keys with dashes or underscores, each known; each value of its field's type (`setting_value`),
    "auto" -> None for the fields that derive it. `where` names the source in errors."""
    check_keys(values, where)
    out, spelled = {}, {}
    for key, v in values.items():
        k = key.replace("-", "_")
        if k in out:
            raise BigfitError(f"{where}: {spelled[k]} and {key} are the same setting; keep one")
        try:
            out[k], spelled[k] = setting_value(k, v), key
        except ValueError as e:
            raise BigfitError(f"{where}: {k} {e}") from None
    return out


def load_config_file(path: str) -> dict:
    """Read a YAML or JSON file of TrainConfig fields; unknown keys and values of the wrong type are
    errors naming them, and so is a file that is missing, a directory, unreadable, not UTF-8 or empty."""
    where = f"config file {path!r}"
    text = read_text(path, where, "a YAML or JSON file of settings")
    p = Path(path)
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = json.loads(text)
    except Exception as e:  # both parsers say where the syntax broke
        raise BigfitError(f"{where} is not valid {p.suffix[1:] or 'JSON'}: {_syntax(e)}") from None
    if not isinstance(values, dict):
        raise BigfitError(f"{where} must hold a mapping of settings, not {type(values).__name__}")
    return normalise(values, where)


def _syntax(e: Exception) -> str:
    """A parser's complaint as one line: PyYAML's spans several, quoting the file's line under a caret."""
    mark, context = getattr(e, "problem_mark", None), getattr(e, "context", None)
    if mark is None:
        return " ".join(str(e).split())
    where = getattr(e, "context_mark", None)
    also = f" ({context}, from line {where.line + 1})" if context and where else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {e.problem}{also}"


def check_keys(values: dict, where: str) -> None:
    """Unknown keys are an error naming each, with the closest setting where one is close."""
    valid = setting_names()
    bad = [k for k in values if not isinstance(k, str) or k.replace("-", "_") not in valid]
    if not bad:
        return
    close = {k: difflib.get_close_matches(str(k).replace("-", "_").lower(), valid, 1) for k in bad}
    named = ", ".join(repr(k) + (f" (did you mean {close[k][0]}?)" if close[k] else "") for k in bad)
    listed = "" if all(close.values()) else f"; valid: {', '.join(valid)}"
    raise BigfitError(f"unknown setting(s) {named} in {where}{listed}")


# Fields bigfit sets for itself, never keys a user writes: probe_only is the flag the launcher gives
# its own probe workers on their command line, extra holds what `resolve` derives.
INTERNAL = ("probe_only", "extra")
_HINTS = typing.get_type_hints(TrainConfig)  # the annotations are strings (from __future__ import annotations)
NOUNS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
HOW = {bool: "write true or false, unquoted", int: "give a whole number", float: "give a number such as 0.001",
       str: "give text in quotes"}


def setting_names() -> list[str]:
    """The keys a user may set: every TrainConfig field but the internal ones."""
    return [n for n in TrainConfig.field_names() if n not in INTERNAL]


def field_type(name: str) -> tuple[type, bool]:
    """(bool, int, float or str; whether None is valid) of a TrainConfig field, from its annotation.
    The str of `int | str` is the "auto" of a PLANNED field, so that type is int."""
    args = typing.get_args(_HINTS[name]) or (_HINTS[name],)
    kinds = [a for a in args if a is not type(None)]
    return (kinds[0] if len(kinds) == 1 else next(k for k in kinds if k is not str)), type(None) in args


def setting_value(name: str, value, in_file: bool = True):
    """`value` (from a file, a DeepSpeed config, or a flag's text) as setting `name` holds it: its
    annotated type; "auto" kept for PLANNED fields, None for AUTO ones. Conversions lose nothing
    (6.0 -> 6, 1 -> 1.0, "1e-3" -> 0.001). ValueError saying what would be valid otherwise."""
    base, optional = field_type(name)
    if isinstance(value, str) and value == "auto" and name in AUTO + PLANNED:
        return None if name in AUTO else value
    if isinstance(value, str) and value == "auto" and base is not str:
        raise ValueError(f"cannot be 'auto'; settings that can: {', '.join(AUTO + PLANNED)}")
    if value is None and optional:
        return None
    try:
        return as_type(base, value)
    except (ValueError, OverflowError):
        raise ValueError(type_problem(name, value, in_file)) from None


def holds(name: str, value) -> bool:
    """Whether `value` already is of setting `name`'s type, unconverted (an int is a float too)."""
    base, optional = field_type(name)
    if value is None or (value == "auto" and name in PLANNED):
        return value is not None or optional
    try:
        return type(as_type(base, value)) is type(value) or (base is float and type(value) is int)
    except (ValueError, OverflowError):
        return False


def type_problem(name: str, value, in_file: bool = True) -> str:
    """'5.5 is not an integer (give a whole number, or auto)': `value` for setting `name`, what is wrong
    and what would be valid (null only where a file can write it)."""
    base, optional = field_type(name)
    ways = [HOW[base]] + (["auto"] if name in AUTO + PLANNED else ["null"] if optional and in_file else [])
    shown = "null" if value is None else repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return f"{shown} is not {NOUNS[base]} ({', or '.join(ways)})"


def as_type(base: type, value):
    """`value` as a `base`, or ValueError. True is an int to Python but never a number to a user. Text
    that reads as a number is that number: PyYAML follows YAML 1.1, where a float needs a dot and a
    signed exponent (1.0e-3), so the 1e-3 and 1e3 people write are strings, a well-known pitfall."""
    if base is bool or isinstance(value, bool):
        if base is bool and isinstance(value, bool):
            return value
        raise ValueError(value)
    if base is str:
        if isinstance(value, str):
            return value
        raise ValueError(value)
    if isinstance(value, str):
        value = int(value) if value.strip().lstrip("+-").isdigit() else float(value)
    if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(value)  # nan and inf too: no setting means them
    if base is int and value != int(value):
        raise ValueError(value)  # 5.5 steps: never rounded
    return base(value)

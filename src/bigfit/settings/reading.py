"""The settings schema, and reading settings as the user writes them.

Every setting of every command is a field of one of four dataclasses: TrainConfig (config.py: the job,
the commands that take each field in config.commands_of), PlanHardware and PlanOutput (settings/planflags.py:
`bigfit plan`'s machine and output) and BenchSettings (settings/bench.py). Its name, annotated type,
default and help (the field's comment) are read from there (`Setting`, `schema`): the parsers of
`bigfit train`, `plan` and `bench` (cli.py), config files, the DeepSpeed import (its values go through
`normalise`) and the Python API (api/__init__.py) all take them from `schema`. Config-file keys may use dashes
or underscores; each value is checked against its field's type (bool, int, float, str, "auto" where a
field takes it); unknown keys get the closest known one. This module sits above the declarations
(config.py never imports it)."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import math
import re
import typing
from pathlib import Path

from ..errors import BigfitError
from . import config
from .bench import BenchSettings
from .config import AUTO, BENCH_DECIDES, PLANNED, TrainConfig, commands_of
from .planflags import ALIASES, PlanHardware, PlanOutput
from .userfiles import read_text

COMMANDS = ("train", "plan", "bench")
# Each declaring dataclass and the commands that take its fields
DECLARED = ((TrainConfig, commands_of), (PlanHardware, lambda name: ("plan",)),
            (PlanOutput, lambda name: ("plan",)), (BenchSettings, lambda name: ("bench",)))


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting as declared: the dataclass field that holds it and the commands that take it."""
    name: str
    owner: type
    commands: tuple[str, ...]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def default(self):
        f = {f.name: f for f in dataclasses.fields(self.owner)}[self.name]
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    @property
    def help(self) -> str:
        return field_help(self.owner)[self.name]


@functools.cache
def schema(command: str) -> dict[str, Setting]:
    """The settings `command` takes, by name, in their declaration order. Built once; not to be changed."""
    return {f.name: Setting(f.name, cls, commands(f.name)) for cls, commands in DECLARED
            for f in dataclasses.fields(cls) if command in commands(f.name)}


def takers(name: str, cls: type | None = None) -> tuple[str, ...]:
    """The commands that take setting `name` (declared by `cls`, else by any dataclass)."""
    return tuple(c for c in COMMANDS if name in schema(c) and (cls is None or schema(c)[name].owner is cls))


def refusal(name: str, command: str) -> str | None:
    """Why `command` does not take setting `name` where another command does, in words: None where no
    command takes it (an unknown name) or `command` does."""
    flag = "--" + ALIASES.get(name, name).replace("_", "-")
    if name in ALIASES and command != "plan":
        return f"--{name.replace('_', '-')} is bigfit plan's name for {flag}, which bigfit {command} takes"
    name = ALIASES.get(name, name)
    others = [c for c in takers(name) if c != command]
    if not others or command in takers(name):
        return None
    if command == "bench" and name in BENCH_DECIDES:
        return f"bigfit bench decides {flag} for each of its rows itself"
    return f"bigfit {command} does not take {flag}: a setting of bigfit {' and '.join(others)}"


@functools.cache
def field_help(cls: type = TrainConfig) -> dict[str, str]:
    """The help text of each field of a settings class: its trailing comment, else the comment lines right
    above it (a field whose comment needs several lines), as `shown` words it."""
    helps, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        field = re.match(r"    (\w+): [^#]*(?:#(.*))?$", line)
        if line.strip().startswith("#"):
            above.append(line.strip()[1:].strip())
            continue
        if field and not line.startswith("    def "):
            helps[field[1]] = shown(field[2].strip() if field[2] else " ".join(above))
        above = []
    return helps


def shown(comment: str) -> str:
    """A field's comment as --help says it: config.py's tuples of names (STRATEGIES) as their values, "None"
    (the field's unset value) as the default it stands for, and % doubled (argparse formats help with it)."""
    def names(m: re.Match) -> str:
        value = getattr(config, m[0], None)
        return ", ".join(value) if isinstance(value, tuple) else m[0]

    return re.sub(r"\bNone:", "default:", re.sub(r"\b[A-Z][A-Z0-9_]+\b", names, comment)).replace("%", "%%")


def normalise(values: dict, where: str, command: str = "train") -> dict:
    """Keys with dashes or underscores, each a setting of `command` (`plan`: of train too, see
    load_config_file); each value of its field's type (`setting_value`), "auto" -> None for the fields
    that derive it. `where` names the source in errors."""
    check_keys(values, where, command)
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


def load_config_file(path: str, command: str = "train") -> dict:
    """Read a YAML or JSON file of settings; unknown keys and values of the wrong type are errors naming
    them, and so is a file that is missing, a directory, unreadable, not UTF-8 or empty. `bigfit plan`
    reads the file `bigfit train` reads (and its own settings): it rates the job's settings among them."""
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
    return normalise(values, where, command)


def _syntax(e: Exception) -> str:
    """A parser's complaint as one line: PyYAML's spans several, quoting the file's line under a caret."""
    mark, context = getattr(e, "problem_mark", None), getattr(e, "context", None)
    if mark is None:
        return " ".join(str(e).split())
    where = getattr(e, "context_mark", None)
    also = f" ({context}, from line {where.line + 1})" if context and where else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {e.problem}{also}"


def check_keys(values: dict, where: str, command: str = "train") -> None:
    """Unknown keys are an error naming each, with the closest setting where one is close; a key another
    command takes is one line saying which. A config file for `bigfit plan` may hold train's settings."""
    valid = setting_names(command) + (setting_names("train") if command == "plan" else [])
    if wrong := [r for k in values if isinstance(k, str) and k.replace("-", "_") not in valid
                 for r in [refusal(k.replace("-", "_"), command)] if r]:
        raise BigfitError(f"{where}: {wrong[0]}")
    bad = [k for k in values if not isinstance(k, str) or k.replace("-", "_") not in valid]
    if not bad:
        return
    close = {k: difflib.get_close_matches(str(k).replace("-", "_").lower(), valid, 1) for k in bad}
    named = ", ".join(repr(k) + (f" (did you mean {close[k][0]}?)" if close[k] else "") for k in bad)
    listed = "" if all(close.values()) else f"; valid: {', '.join(valid)}"
    raise BigfitError(f"unknown setting(s) {named} in {where}{listed}")


# Fields bigfit sets for itself, never keys a user writes: probe_only is the flag the launcher gives
# its own probe workers (in the job it writes for them).
INTERNAL = ("probe_only",)
# the annotations are strings (from __future__ import annotations); TrainConfig's first, where two declare a name
_HINTS = {k: v for cls, _ in reversed(DECLARED) for k, v in typing.get_type_hints(cls).items()}
NOUNS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
HOW = {bool: "write true or false, unquoted", int: "give a whole number", float: "give a number such as 0.001",
       str: "give text in quotes"}


def setting_names(command: str = "train") -> list[str]:
    """The keys a user may set for `command`: every setting it takes but the internal ones."""
    return [n for n in schema(command) if n not in INTERNAL]


def field_type(name: str) -> tuple[type, bool]:
    """(bool, int, float or str; whether None is valid) of a setting, from its field's annotation (a name
    two dataclasses declare has one type). The str of `int | str` is the "auto" of a PLANNED field, so
    that type is int."""
    hint = _HINTS[name]
    args = typing.get_args(hint) or (hint,)
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

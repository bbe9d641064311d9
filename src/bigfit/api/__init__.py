"""bigfit from Python (a notebook, a script), without a subprocess of one's own: `train` and `plan` take
the settings the command line takes, by the names of the one settings schema (settings/reading.py: a job's
settings are TrainConfig's fields for both; `bigfit plan` adds the machine it rates), run the same code
the commands run, and return data.

    import bigfit
    result = bigfit.train(model="google-t5/t5-small", data="pairs.jsonl", strategy="auto", max_steps=2000)
    result["metrics"]["loss"], result["model_dir"]
    bigfit.plan(model="./my-llama", gpus="24GB,8GB", batch_size=8, max_source_len=2048)["recommended"]

Several processes are started as `bigfit train` starts them: new Python processes (never forks), so
a notebook that has touched CUDA already starts its workers cleanly.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path

from ..errors import BigfitError
from ..settings.config import TrainConfig


def train(config: TrainConfig | None = None, /, *, tokenizer=None, **settings) -> dict:
    """Train as `bigfit train` does, with a TrainConfig or settings by name (model=..., data=...,
    strategy=..., batch_size=...). `model` may be a transformers PreTrainedModel (with `tokenizer`,
    else the byte-level one) and `data` a datasets.Dataset, a DatasetDict or a list of example dicts:
    each is written once to bigfit's cache of inputs (inputs.py) for the workers to read. Returns
    {"output_dir", "metrics": the last step's record, "eval": the last evaluation's or None,
    "model_dir" / "adapter_dir" where the run wrote one}. A bad setting raises BigfitError with the
    one line the command prints, before any work."""
    from ..job.checks import validate
    from ..common.processes import stamp_start
    from ..settings.reading import check_keys

    if config is not None and settings:
        raise BigfitError("bigfit.train() takes a TrainConfig or settings by name, not both")
    if config is None:
        check_keys(settings, "bigfit.train()")  # the settings schema's names: a plan-only one is said to be so
        settings = {k.replace("-", "_"): v for k, v in settings.items()}
        objects = {k: None for k in ("model", "data") if not isinstance(settings.get(k), (str, type(None)))}
        # every setting's mistake before an object is written; the objects' paths are bigfit's own
        validate(TrainConfig(**{**settings, **objects}))
        settings.update(_paths(settings, tokenizer))
        config = TrainConfig(**settings)
    elif tokenizer is not None:
        raise BigfitError("bigfit.train(): tokenizer= goes with model= given as a model object, not with a TrainConfig")
    else:
        validate(config)  # validated once, as the command line's settings are
    stamp_start()
    from ..commands.train import train_command  # the training stack, imported when a run starts

    code = train_command(["train"], config)
    out = Path(config.output_dir)
    if code:
        raise BigfitError(f"training stopped (exit status {code}): the report is above; logs in {out / 'logs'}")
    return _result(out)


run = train  # the same call, by the name it first had


def plan(**settings) -> dict:
    """`bigfit plan`'s plan as data (what `bigfit plan --json` prints): its settings by name, as on the
    command line and in bigfit.train (model="google-t5/t5-3b", gpus="8x16GB", batch_size=32,
    activation_checkpointing=True); None or False: not given. Checked against the settings schema
    (settings/reading.py) as the command line checks them, one BigfitError line for a mistake.
    max_seq_len=True: each row's longest sequence instead (`bigfit plan --max-seq-len --json`)."""
    from ..commands.plan import compute_longest, compute_plan, longest_json, plan_json, plan_settings
    from ..settings.planflags import ALIASES
    from ..settings.reading import refusal, schema, setting_value

    known = sorted([*schema("plan"), *ALIASES])
    if bad := [k for k in settings if k not in known]:
        raise BigfitError("bigfit.plan(): " + (refusal(bad[0], "plan") or "unknown flag(s) " + ", ".join(
            repr(k) + (f" (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, known, 1)) else "")
            for k in bad) + f"; valid: {', '.join(known)}"))
    given = {k: v for k, v in settings.items() if v is not None and v is not False}
    for k, v in given.items():
        try:
            setting_value(ALIASES.get(k, k), v, in_file=False)
        except ValueError as e:  # the command line's words: argument --batch-size: 'many' is not an integer
            raise BigfitError(f"bigfit.plan(): argument --{k.replace('_', '-')}: {e}") from None
    cfg, machine, out = plan_settings(given)
    if out.max_seq_len:  # each row's longest sequence, as `bigfit plan --max-seq-len --json` prints it
        return json.loads(json.dumps(longest_json(*compute_longest(cfg, machine))))
    p, _, _, rated = compute_plan(cfg, machine)
    return json.loads(json.dumps(plan_json(p, rated)))  # lists and dicts alone, as --json prints it


def _paths(settings: dict, tokenizer) -> dict:
    """model= and data= objects as the paths the workers read (inputs.py); paths and names as given."""
    from . import inputs

    out = {}
    if settings.get("model") is not None and not isinstance(settings["model"], str):
        out["model"] = inputs.model_path(settings["model"], tokenizer)
    elif tokenizer is not None:
        raise BigfitError("bigfit.train(): tokenizer= goes with model= given as a model object; a model directory "
                          "or hub name brings its own tokenizer files")
    if settings.get("data") is not None and not isinstance(settings["data"], str):
        out["data"] = inputs.data_path(settings["data"])
    return out


def _result(out: Path) -> dict:
    metrics = _last(out / "metrics.jsonl")
    result = {"output_dir": str(out), "metrics": metrics, "eval": _last(out / "eval.jsonl")}
    for name in ("model", "adapter"):
        if (out / name).is_dir():
            result[f"{name}_dir"] = str(out / name)
    return result


def _last(path: Path) -> dict | None:
    lines = [x for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return json.loads(lines[-1]) if lines else None

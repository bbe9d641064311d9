"""The settings schema (settings/reading.py): every flag of `bigfit train`, `plan` and `bench` is a declared
setting with one default; `bigfit plan` and `bigfit train` given the same settings rate the same planner
Job, and the plan's row for the strategy train runs is train's prediction (job/autoplan.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from bigfit.cli import config_from_args, main, parse_args, parsers
from bigfit.settings.config import PLAN_TAKES
from bigfit.settings.reading import COMMANDS, schema
from conftest import one_line

# parser options that are no setting: a file of settings, and bigfit plan's earlier names of two
NOT_SETTINGS = {"--help", "--config", "--deepspeed-config", "--seq-len", "--target-len"}
# bench's own directory (bench-out), declared by BenchSettings beside TrainConfig's (which bench decides itself)
TWICE = {"output_dir", "overwrite"}


def _options(command: str) -> dict[str, argparse.Action]:
    _, commands = parsers()
    return {s: a for a in commands[command]._actions for s in a.option_strings if s.startswith("--")}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_a_declared_setting(command):
    options = _options(command)
    declared = schema(command)
    flags = {("--no-" + s.flag[2:]) if s.default is True else s.flag: s for s in declared.values()}
    assert set(options) - NOT_SETTINGS == set(flags)
    for flag, s in flags.items():  # the flag sets its setting, and leaves the default to the declaration
        assert options[flag].dest == s.name and options[flag].default is argparse.SUPPRESS, flag


def test_one_default_and_one_help_per_name_across_commands():
    seen: dict[str, set] = {}
    for command in COMMANDS:
        for s in schema(command).values():
            seen.setdefault(s.name, set()).add((s.owner, repr(s.default), s.help))
    assert {n for n, d in seen.items() if len(d) > 1} == TWICE
    assert schema("bench")["output_dir"].default == "bench-out" and schema("train")["output_dir"].default == "bigfit-out"
    assert schema("plan")["precision"].default is None  # auto, for every command
    assert set(schema("plan")) >= set(PLAN_TAKES) | {"gpus", "nodes", "cpu_ram", "json", "plot", "calibrate"}


def test_a_setting_of_another_command_is_one_line_naming_it(capsys):
    for argv, words in ((["plan", "--resume"], "bigfit plan does not take --resume: a setting of bigfit train"),
                        (["train", "--gpus", "8x16GB"], "bigfit train does not take --gpus: a setting of bigfit plan"),
                        (["train", "--seq-len", "64"], "--seq-len is bigfit plan's name for --max-source-len")):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2 and words in one_line(capsys.readouterr().err)
    _, commands = parsers()
    assert "(train and bench only)" in commands["train"].format_help()  # --lr: in its help too
    assert "(plan only)" in commands["plan"].format_help()


def _plan(argv, capsys) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_and_train_take_the_same_defaults_and_rate_the_same_job(model_dirs, capsys):
    """`bigfit plan --model M` and `bigfit train --model M`: the same TrainConfig, and the planner Job the
    plan rates is the one train's auto decisions rate on this machine (2 processes on the CPU)."""
    from bigfit.job import autoplan as auto
    from bigfit.commands.plan import settings_of_args

    model = str(model_dirs["t5"])
    planned, _, _ = settings_of_args(parse_args(["plan", "--model", model]))
    trained = config_from_args(parse_args(["train", "--model", model]))
    assert {n: getattr(planned, n) for n in PLAN_TAKES} == {n: getattr(trained, n) for n in PLAN_TAKES}
    p = _plan(["--model", model], capsys)
    job = dataclasses.asdict(auto._auto_job(trained, 2)[2])
    assert {k: p["job"][k] for k in job} == {**job, "lora": None}
    assert (job["seq_len"], job["target_len"], job["precision"]) == (128, 128, "fp32")  # train's, on the CPU
    assert p["job"]["strategy"] == "zero3" and p["job"]["processes"] == 2
    assert p["job"]["text"].startswith(f"job: {model}, global batch 32 / micro-batch 16, 128 source / 128 target")


def test_the_plans_row_for_trains_strategy_is_trains_prediction(model_dirs, capsys):
    """The same flags to `bigfit plan --json` and `bigfit train`: the plan's row for the strategy train runs
    (ddp on 2 CPU processes) says what train's prediction says, and holds the same bytes and seconds."""
    from bigfit.job.autoplan import predicted_row, prediction, row_text
    from bigfit.job.resolution import resolve

    flags = ["--model", str(model_dirs["llama"]), "--strategy", "ddp", "--batch-size", "8", "--max-source-len", "64",
             "--activation-checkpointing"]
    (row,) = [r for r in _plan(flags, capsys)["strategies"] if r["name"] == "ddp"]
    cfg = resolve(config_from_args(parse_args(["train", *flags, "--nproc", "2"])), 2).cfg
    said = prediction(cfg, 2)
    assert said == row_text(row) and said.startswith("ddp: ") and " GB peak per device, " in said
    rated = predicted_row(cfg, 2).to_json()
    assert (rated["per_gpu_bytes"], rated["step_time_s"]) == (row["per_gpu_bytes"], row["step_time_s"])


def test_the_python_api_takes_the_schemas_names(model_dirs):
    import bigfit
    from bigfit.errors import BigfitError

    with pytest.raises(BigfitError, match=r"bigfit.plan\(\): bigfit plan does not take --lr: a setting of bigfit train"):
        bigfit.plan(model=str(model_dirs["llama"]), lr=1e-3)
    with pytest.raises(BigfitError, match=r"bigfit.train\(\): bigfit train does not take --gpus"):
        bigfit.train(gpus="8x16GB")
    with pytest.raises(BigfitError, match=r"bigfit.plan\(\): argument --max-source-len: 'long' is not an integer"):
        bigfit.plan(model=str(model_dirs["llama"]), max_source_len="long")


def test_plan_rates_the_datas_longest_sample_as_train_does(model_dirs, pairs_file, capsys):
    from bigfit.planning.workload import planned_lengths
    from bigfit.job.prepare import data_lengths

    flags = ["--model", str(model_dirs["t5"]), "--data", str(pairs_file), "--gpus", "2x8GB"]
    p = _plan(flags, capsys)
    cfg = config_from_args(parse_args(["train", *flags[:4]]))
    assert (p["job"]["seq_len"], p["job"]["target_len"]) == planned_lengths(cfg, data_lengths(cfg)) != (128, 128)
    assert p["job"]["precision"] == "bf16" and f"the longest of {pairs_file}" in p["job"]["text"]  # GPUs: bf16

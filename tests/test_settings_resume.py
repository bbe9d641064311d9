"""--resume checks what it resumes: settings that change the math are refused with old and new value
unless --allow-changed names them; layout settings (processes, micro-batch, strategy) are allowed
and said."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from bigfit.cli import main
from bigfit.settings import resume
from bigfit.settings.config import TrainConfig
from conftest import one_line, read_jsonl, snapshot


def test_every_setting_is_math_layout_or_free_exactly_once():
    groups = [set(resume.MATH), set(resume.LAYOUT), set(resume.FREE)]
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set.union(*groups) == names
    assert sum(map(len, groups)) == len(names)


def test_changed_batch_size_and_seed_are_refused_naming_old_and_new(run_copy, capsys):
    out, args = run_copy
    before = snapshot(out)
    code = main([*args, "--output-dir", str(out), "--resume", "--batch-size", "8", "--seed", "3"])
    line = one_line(capsys.readouterr().err)
    assert code == 2
    assert "batch_size 4 -> 8; seed 0 -> 3" in line and "--allow-changed batch_size,seed" in line
    assert snapshot(out) == before


def test_changed_data_content_is_refused_even_under_the_same_path(run_copy, tmp_path, capsys):
    out, args = run_copy
    data = Path(args[args.index("--data") + 1])
    moved = tmp_path / "pairs.jsonl"
    moved.write_text(data.read_text().replace('"target": "1', '"target": "9', 1))
    args = [a if a != str(data) else str(moved) for a in args]
    code = main([*args, "--output-dir", str(out), "--resume"])
    assert code == 2 and "data (the file's content: sha256" in one_line(capsys.readouterr().err)


def test_another_architecture_is_refused_naming_the_keys(run_copy, model_dirs, tmp_path, capsys):
    from tiny import tiny_config

    out, args = run_copy
    wider = tiny_config("t5")
    wider.d_ff = 128
    wider.save_pretrained(tmp_path / "wider")
    args = [a if a != str(model_dirs["t5"]) else str(tmp_path / "wider") for a in args]
    code = main([*args, "--output-dir", str(out), "--resume"])
    assert code == 2 and "model (d_ff 64 -> 128)" in one_line(capsys.readouterr().err)


def test_allowed_changes_and_layout_changes_run_and_are_said(run_copy, tmp_path, capsys):
    """A moved data file with the same content, another micro-batch and a longer run (the schedule is
    constant: max_steps changes nothing of it), and a seed the user allows."""
    out, args = run_copy
    data = Path(args[args.index("--data") + 1])
    shutil.copy(data, tmp_path / "moved.jsonl")
    args = [a if a != str(data) else str(tmp_path / "moved.jsonl") for a in args]
    code = main([*args, "--output-dir", str(out), "--resume", "--max-steps", "6", "--micro-batch-size", "2",
                 "--seed", "5", "--allow-changed", "seed"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    text = " ".join(printed.out.split())
    assert "note: seed 0 -> 5 (allowed by --allow-changed)" in text
    assert "note: resuming with micro_batch_size 2; saved with 4" in text
    assert "the same content" in text
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    run = json.loads((out / "run.json").read_text())
    assert len(run["starts"]) == 2 and run["starts"][1]["resumed_from"].endswith("step-00000004")


def test_max_steps_of_a_decaying_schedule_changes_the_math(finished_run, capsys):
    saved = {"config": {"max_steps": 4, "lr_schedule": "linear"}, "world_size": 1, "identity": {}}
    now = {"config": {"max_steps": 8, "lr_schedule": "linear"}, "world_size": 2, "identity": {}}
    refused, notes = resume.compare(saved, now, set())
    assert refused == ["max_steps 4 -> 8"]
    assert notes == ["note: resuming at 2 processes; saved with 1"]
    assert resume.compare(saved, now, {"max_steps"})[0] == []


@pytest.mark.parametrize("argv,needle", [
    (["--allow-changed", "strategy"], "--allow-changed strategy: not a setting that changes the math"),
    (["--overwrite"], "--overwrite would remove the run"),
])
def test_resume_flags_that_contradict_are_one_line(run_copy, capsys, argv, needle):
    out, args = run_copy
    before = snapshot(out)
    code = main([*args, "--output-dir", str(out), "--resume", *argv])
    assert code == 2 and needle in one_line(capsys.readouterr().err)
    assert snapshot(out) == before


def test_allow_changed_without_resume_is_one_line(tmp_path, capsys):
    assert main(["train", "--strategy", "single", "--allow-changed", "seed", "--output-dir", str(tmp_path / "o")]) == 2
    assert "--allow-changed belongs to --resume" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_another_process_count_and_strategy_resume_and_are_said(run_copy, capsys):
    """A one-process checkpoint continues on 2 ranks under ZeRO-3 (started by the launcher, which
    claims the directory and hands its lock to the workers)."""
    out, args = run_copy
    code = main([*args, "--output-dir", str(out), "--resume", "--max-steps", "6", "--nproc", "2", "--strategy", "zero3"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    text = " ".join(printed.out.split())
    assert "note: resuming at 2 processes; saved with 1" in text
    assert "note: resuming with strategy 'zero3'; saved with 'single'" in text
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert not (out / ".bigfit-lock").exists()  # released with the job

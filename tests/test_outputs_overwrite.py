"""--overwrite removes exactly what bigfit's records say it wrote: never through a symbolic link (a
link goes as a link, what it points to stays), never a file no record matches (a user's, or one
changed since), never an input of the run; an output directory inside a checkpoint or a model
directory is refused. Each refusal is exit status 2 and one line, with every file, link and link
target as it was. Success cases run the claim alone (no training): it is where --overwrite removes."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from bigfit.cli import main
from conftest import RUN_ARGS, bigfit, one_line

STEP2, STEP4 = "checkpoints/step-00000002", "checkpoints/step-00000004"


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under `root`, never through a link: a file's bytes, a link's target, a folder.
    Equal trees mean nothing was touched (conftest's `snapshot` follows links: it would miss a link
    that went, and read its target as the link's own)."""
    found = {}
    for folder, dirs, files in os.walk(root):  # os.walk lists a link to a folder without entering it
        for name in dirs + files:
            p = Path(folder) / name
            rel = str(p.relative_to(root))
            found[rel] = ("link", os.readlink(p)) if p.is_symlink() else ("dir",) if p.is_dir() else ("file", p.read_bytes())
    return found


def user_model(d: Path) -> Path:
    """A user's own Hugging Face model directory (nothing may touch its bytes)."""
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "t5", "mine": true}')
    (d / "model.safetensors").write_bytes(b"the user's own weights")
    (d / "tokenizer_config.json").write_text('{"mine": true}')
    return d


def train_args(args: list[str], out: Path, *extra) -> list[str]:
    return [*args, "--output-dir", str(out), *map(str, extra)]


def claim_lines(argv: list[str]) -> list[str]:
    """What the claim of `bigfit ARGV` says, run in this process without the training after it."""
    from bigfit.cli import config_from_args, parse_args
    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import prepare
    from bigfit.outputs.ownership import claim

    lines = []
    with claim(prepare(resolve(config_from_args(parse_args(argv)), 1)), speak=lines.append):
        pass
    return lines


def refused(argv: list[str], capsys) -> str:
    """`bigfit ARGV` in this process: exit status 2 and its one line."""
    assert main(argv) == 2
    return one_line(capsys.readouterr().err)


def test_overwrite_refuses_a_model_that_lies_in_the_run_it_replaces(run_copy, pairs_file, tmp_path):
    """`--model out/model --output-dir out --overwrite` once removed out/model, then failed for want of it."""
    out, _ = run_copy
    before = tree(tmp_path)
    r = bigfit("train", "--model", out / "model", "--data", pairs_file, *RUN_ARGS, "--output-dir", out, "--overwrite")
    line = one_line(r.stderr)
    assert r.returncode == 2 and f"--model '{out / 'model'}' lies in what --overwrite would remove" in line, line
    assert tree(tmp_path) == before


def test_a_model_reached_through_a_link_the_overwrite_removes_is_refused(run_copy, model_dirs, tmp_path, capsys):
    out, args = run_copy
    shutil.rmtree(out / "model")
    shutil.copytree(model_dirs["t5"], tmp_path / "mine")  # a model directory of config.json alone
    os.symlink(tmp_path / "mine", out / "model")
    argv = train_args(args, out, "--overwrite")
    argv[argv.index("--model") + 1] = str(out / "model")
    before = tree(tmp_path)
    assert "lies in what --overwrite would remove" in refused(argv, capsys)
    assert tree(tmp_path) == before


def test_a_settings_file_among_the_files_the_overwrite_removes_is_refused(run_copy, tmp_path, capsys):
    """--config and --deepspeed-config leave no trace in the settings: the claim reads them off the command line."""
    out, args = run_copy
    before = tree(tmp_path)
    ds = out / STEP2 / "trainer.json"  # a JSON object DeepSpeed's mapping takes, its keys ignored
    line = refused(train_args(args, out, "--overwrite", f"--deepspeed={ds}"), capsys)
    assert f"--deepspeed-config '{ds}' lies in what --overwrite would remove" in line
    assert tree(tmp_path) == before


def test_a_users_model_files_where_the_runs_model_goes_are_kept_and_refused(run_copy, tmp_path, capsys):
    """OUT/model without bigfit-model.json: no "legacy" rule removes the user's config and weights."""
    out, args = run_copy
    shutil.rmtree(out / "model")
    user_model(out / "model")
    before = tree(tmp_path)
    line = refused(train_args(args, out, "--overwrite"), capsys)
    assert "model/config.json, model/model.safetensors, model/tokenizer_config.json" in line
    assert "no bigfit record matches" in line and "--no-consolidate" in line
    assert tree(tmp_path) == before


def test_without_consolidation_a_users_model_files_are_kept_and_named(run_copy):
    out, args = run_copy
    shutil.rmtree(out / "model")
    mine = tree(user_model(out / "model"))
    lines = claim_lines(train_args(args, out, "--overwrite", "--no-consolidate"))
    assert tree(out / "model") == mine and not (out / "checkpoints").exists()
    assert "kept, as no bigfit record matches them: model/config.json" in lines[-1]


def test_changed_files_are_no_longer_bigfits_to_remove(run_copy, tmp_path, capsys):
    """A file of the same size with other bytes (a user's edit) is told by its checksum."""
    out, args = run_copy
    config = out / "model" / "config.json"
    config.write_bytes(config.read_bytes().replace(b'"t5"', b'"T5"'))
    before = tree(tmp_path)
    assert "holds model/config.json, which no bigfit record matches" in refused(train_args(args, out, "--overwrite"),
                                                                                 capsys)
    assert tree(tmp_path) == before
    state = out / STEP2 / "trainer.json"  # a checkpoint's file: the new run's save of step 2 would replace it
    state.write_text(state.read_text().replace('"step": 2', '"step": 3'))
    before = tree(tmp_path)
    assert f"holds {STEP2}/trainer.json" in refused(train_args(args, out, "--overwrite", "--no-consolidate"), capsys)
    assert tree(tmp_path) == before


def test_logs_without_a_run_json_are_kept(run_copy, tmp_path, capsys):
    out, args = run_copy
    (out / "run.json").unlink()
    before = tree(tmp_path)
    assert "holds metrics.jsonl, eval.jsonl" in refused(train_args(args, out, "--overwrite"), capsys)
    assert tree(tmp_path) == before


def test_overwrite_removes_a_model_link_as_a_link_and_the_run_writes_a_directory(finished_run, run_copy, tmp_path):
    """OUT/model a link to a user's directory: once emptied, its files moved into the new OUT/model."""
    from bigfit.outputs.consolidate import consolidate

    out, args = run_copy
    shutil.rmtree(out / "model")
    os.symlink(user_model(tmp_path / "mine"), out / "model")
    mine = tree(tmp_path / "mine")
    lines = claim_lines(train_args(args, out, "--overwrite"))
    assert not os.path.lexists(out / "model") and tree(tmp_path / "mine") == mine
    assert "links removed as links, what they point to untouched: model" in lines[-1]
    consolidate(finished_run[0] / STEP4, out / "model", overwrite=True)  # what the run does at its end
    assert not (out / "model").is_symlink() and (out / "model" / "bigfit-model.json").is_file()
    assert tree(tmp_path / "mine") == mine


def test_links_anywhere_in_the_run_directory_go_as_links(run_copy, tmp_path):
    """A step-N, a .partial, a log file and the logs folder that are links: once OSError tracebacks."""
    out, args = run_copy
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(out / STEP2, elsewhere / "ckpt")
    (elsewhere / "partial").mkdir()
    (elsewhere / "partial" / "keep.txt").write_text("mine")
    (elsewhere / "metrics.jsonl").write_text("my own metrics\n")
    (elsewhere / "logs").mkdir()
    (elsewhere / "logs" / "rank-1.log").write_text("my own log")
    shutil.rmtree(out / STEP2)
    (out / "metrics.jsonl").unlink()
    links = {STEP2: "ckpt", "checkpoints/.step-00000006.partial": "partial", "metrics.jsonl": "metrics.jsonl",
             "logs": "logs"}
    for name, target in links.items():
        os.symlink(elsewhere / target, out / name)
    before = tree(elsewhere)
    lines = claim_lines(train_args(args, out, "--overwrite"))
    assert "links removed as links" in lines[-1]
    assert not any(os.path.lexists(out / name) for name in links) and not (out / "checkpoints").exists()
    assert tree(elsewhere) == before


@pytest.mark.parametrize("inside", ["checkpoint", "bigfit model", "hugging face model", "the model itself"])
def test_an_output_dir_inside_a_checkpoint_or_model_directory_is_refused(run_copy, tmp_path, capsys, inside):
    out, args = run_copy
    target = {"checkpoint": out / STEP4 / "run", "bigfit model": out / "model" / "run",
              "hugging face model": tmp_path / "mine" / "runs" / "a", "the model itself": tmp_path / "mine"}[inside]
    if "model" in inside and "bigfit" not in inside:
        user_model(tmp_path / "mine")
    before = tree(tmp_path)
    line = refused(train_args(args, target), capsys)
    assert "lies inside the" in line or "is the model directory" in line, line
    assert tree(tmp_path) == before


def test_consolidate_replaces_a_link_only_with_overwrite_and_never_its_target(run_copy, tmp_path, capsys):
    out, _ = run_copy
    os.symlink(user_model(tmp_path / "mine"), tmp_path / "model")
    before = tree(tmp_path)
    line = refused(["consolidate", str(out / STEP4), str(tmp_path / "model")], capsys)
    assert "is a symbolic link" in line and "--overwrite" in line
    assert tree(tmp_path) == before
    assert main(["consolidate", str(out / STEP4), str(tmp_path / "model"), "--overwrite"]) == 0
    assert not (tmp_path / "model").is_symlink() and (tmp_path / "model" / "model.safetensors").is_file()
    assert {k: v for k, v in tree(tmp_path).items() if k.startswith("mine")} == \
        {k: v for k, v in before.items() if k.startswith("mine")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "model", "out"]  # nothing left beside them


def test_consolidate_keeps_a_changed_file_and_refuses_a_checkpoint_as_its_folder(run_copy, tmp_path, capsys):
    out, _ = run_copy
    model = out / "model"
    (model / "config.json").write_text(json.dumps({"edited": "by the user"}))
    before = tree(tmp_path)
    assert "'config.json', which no record of bigfit's matches" in refused(
        ["consolidate", str(out / STEP4), str(model), "--overwrite"], capsys)
    assert "lies inside the checkpoint" in refused(["consolidate", str(out / STEP4), str(out / STEP2 / "model")], capsys)
    assert tree(tmp_path) == before


def test_a_lock_file_that_is_a_link_is_never_written_through(tmp_path, model_dirs, capsys):
    (tmp_path / "mine.txt").write_text("mine")
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "mine.txt", tmp_path / "out" / ".bigfit-lock")
    before = tree(tmp_path)
    line = refused(["train", "--model", str(model_dirs["t5"]), "--strategy", "single", "--output-dir",
                    str(tmp_path / "out")], capsys)
    assert ".bigfit-lock is a symbolic link" in line
    assert tree(tmp_path) == before

"""Output directories belong to one run, and consolidate never deletes what it did not write: each
case refuses with exit status 2 and one line, and every file that was there is byte-for-byte intact."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bigfit.cli import main
from conftest import bigfit, one_line, read_jsonl, snapshot


def user_files(root: Path) -> None:
    """What a user might keep where bigfit writes: a thesis, results in a subdirectory."""
    (root / "results" / "2026").mkdir(parents=True, exist_ok=True)
    (root / "thesis.pdf").write_bytes(b"%PDF-1.7 chapter one")
    (root / "results" / "2026" / "table.csv").write_text("a,b\n1,2\n")


def test_consolidate_refuses_a_directory_of_user_files(run_copy, tmp_path, capsys):
    out, _ = run_copy
    user_files(tmp_path / "mine")
    before = snapshot(tmp_path / "mine")
    assert main(["consolidate", str(out / "checkpoints" / "step-00000004"), str(tmp_path / "mine")]) == 2
    assert "holds files bigfit did not write" in one_line(capsys.readouterr().err)
    assert snapshot(tmp_path / "mine") == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial left


def test_consolidate_into_the_working_directory_is_refused(run_copy, tmp_path):
    """Through a real process: `bigfit consolidate CKPT .` would once have wiped the directory."""
    out, _ = run_copy
    user_files(tmp_path / "work")
    before = snapshot(tmp_path / "work")
    r = bigfit("consolidate", out / "checkpoints" / "step-00000004", ".", cwd=tmp_path / "work")
    assert r.returncode == 2 and "current directory" in one_line(r.stderr)
    assert snapshot(tmp_path / "work") == before


def test_consolidate_into_a_regular_file_leaves_it_and_no_partial(run_copy, tmp_path, capsys):
    out, _ = run_copy
    (tmp_path / "model").write_text("not a directory")
    assert main(["consolidate", str(out / "checkpoints" / "step-00000004"), str(tmp_path / "model")]) == 2
    assert "is a file" in one_line(capsys.readouterr().err)
    assert (tmp_path / "model").read_text() == "not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_consolidate_replaces_its_own_model_only_with_overwrite_and_keeps_other_files(run_copy, tmp_path, capsys):
    from transformers import AutoModelForSeq2SeqLM

    out, _ = run_copy
    target = tmp_path / "model"
    assert main(["consolidate", str(out / "checkpoints" / "step-00000002"), str(target)]) == 0
    (target / "NOTES.md").write_text("my notes on this model")
    before = snapshot(target)
    assert main(["consolidate", str(out / "checkpoints" / "step-00000004"), str(target)]) == 2
    assert "--overwrite" in one_line(capsys.readouterr().err)
    assert snapshot(target) == before
    assert main(["consolidate", str(out / "checkpoints" / "step-00000004"), str(target), "--overwrite"]) == 0
    assert (target / "NOTES.md").read_text() == "my notes on this model"
    assert json.loads((target / "bigfit-model.json").read_text())["checkpoint"].endswith("step-00000004")
    assert (target / "model.safetensors").read_bytes() != before["model.safetensors"]
    AutoModelForSeq2SeqLM.from_pretrained(target)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_replacement_that_fails_half_way_puts_the_users_files_back(run_copy, tmp_path, capsys, monkeypatch):
    """The user's files moved into the new directory go back when the swap itself fails."""
    import types

    from bigfit.outputs import consolidate

    out, _ = run_copy
    target = tmp_path / "model"
    assert main(["consolidate", str(out / "checkpoints" / "step-00000002"), str(target)]) == 0
    (target / "NOTES.md").write_text("my notes")
    before = snapshot(target)

    def rename(a, b):
        if Path(a) == target:  # the old directory's move aside, after the user's files moved
            raise OSError(16, "Device or resource busy", str(a))
        os.rename(a, b)

    monkeypatch.setattr(consolidate, "os", types.SimpleNamespace(**{**vars(os), "rename": rename}))
    assert main(["consolidate", str(out / "checkpoints" / "step-00000004"), str(target), "--overwrite"]) == 2
    assert "Device or resource busy" in one_line(capsys.readouterr().err)
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_a_failed_consolidation_leaves_nothing_behind(run_copy, tmp_path, capsys, monkeypatch):
    from bigfit.outputs import consolidate

    out, _ = run_copy

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(args[1]))

    monkeypatch.setattr(consolidate, "save_file", disk_full)
    assert main(["consolidate", str(out / "checkpoints" / "step-00000004"), str(tmp_path / "model")]) == 2
    assert "No space left on device" in one_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_new_run_into_a_directory_holding_a_run_is_refused(run_copy, capsys):
    out, args = run_copy
    before = snapshot(out)
    assert main([*args, "--output-dir", str(out)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "holds the run" in line and "--resume" in line and "--overwrite" in line
    assert snapshot(out) == before


def test_overwrite_removes_that_runs_files_and_nothing_else(run_copy, capsys):
    out, args = run_copy
    old_id = json.loads((out / "run.json").read_text())["run_id"]
    user_files(out)
    (out / "checkpoints" / "README").write_text("my note about these checkpoints")
    (out / "model" / "card.md").write_text("my model card")
    mine = {k: v for k, v in snapshot(out).items() if k.startswith(("thesis", "results")) or k.endswith(("README", "card.md"))}
    assert main([*args, "--output-dir", str(out), "--max-steps", "2", "--overwrite"]) == 0
    assert "removed the run" in capsys.readouterr().out
    assert {k: v for k, v in snapshot(out).items() if k in mine} == mine  # every user file, byte for byte
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["README", "step-00000002"]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert json.loads((out / "run.json").read_text())["run_id"] != old_id


def test_a_run_into_a_locked_directory_names_the_holder(tmp_path, model_dirs, pairs_file, capsys):
    """The lock is the open file's flock: a second open of it conflicts even in this process."""
    from bigfit.outputs.lock import RunLock

    out = tmp_path / "out"
    lock = RunLock(out).acquire()
    (out / "keep.txt").write_text("mine")
    before = snapshot(out)
    try:
        code = main(["train", "--model", str(model_dirs["t5"]), "--data", str(pairs_file), "--strategy", "single",
                     "--output-dir", str(out)])
        assert snapshot(out) == before
    finally:
        lock.release()
    assert code == 2
    line = one_line(capsys.readouterr().err)
    assert "in use by another bigfit run" in line and f"pid {os.getpid()} on host {socket.gethostname()}" in line


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path):
    from bigfit.outputs.lock import RunLock

    (tmp_path / ".bigfit-lock").write_text(json.dumps({"pid": 999999, "host": "gone", "started": 0}))
    lock = RunLock(tmp_path).acquire()  # no process holds it: the kernel released it when its holder died
    try:
        assert "was left by pid 999999 on host gone" in lock.notes[0]
        assert json.loads((tmp_path / ".bigfit-lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (tmp_path / ".bigfit-lock").exists()


def test_two_runs_started_at_once_into_one_directory(tmp_path, model_dirs, pairs_file):
    """Exactly one trains: the other is refused (locked, or finding the first's run there) and
    leaves the winner's files as they were."""
    args = ["train", "--model", model_dirs["t5"], "--data", pairs_file, "--strategy", "single", "--max-steps", "3",
            "--batch-size", "4", "--eval-samples", "4", "--num-beams", "1", "--output-dir", tmp_path / "out"]
    env = {k: v for k, v in os.environ.items() if k != "BIGFIT_OUTPUT_CLAIMED"}
    procs = [subprocess.Popen([sys.executable, "-m", "bigfit", *map(str, args)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2]
    line = one_line(next(err for code, err in results if code == 2))
    assert "in use by another bigfit run" in line or "holds the run" in line
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert len(run["starts"]) == 1
    assert [r["step"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("case", ["file", "under-a-file"])
def test_output_dir_in_the_way_is_one_line(tmp_path, model_dirs, capsys, case):
    (tmp_path / "taken").write_text("a file")
    out = tmp_path / "taken" if case == "file" else tmp_path / "taken" / "out"
    assert main(["train", "--model", str(model_dirs["t5"]), "--strategy", "single", "--output-dir", str(out)]) == 2
    assert "is a file" in one_line(capsys.readouterr().err)
    assert (tmp_path / "taken").read_text() == "a file"


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only file system: a tmpfs mounted read-only where this user may mount
    (root in the CI container), else skipped."""
    target = tmp_path / "ro"
    target.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "none", str(target)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only file system here")
    yield target
    subprocess.run(["umount", str(target)], check=True)


def test_output_dir_on_a_read_only_file_system(read_only_dir, model_dirs, pairs_file, run_copy, capsys):
    r = bigfit("train", "--model", model_dirs["t5"], "--data", pairs_file, "--strategy", "single", "--output-dir",
            read_only_dir / "out")
    assert r.returncode == 2 and "read-only file system" in one_line(r.stderr)
    out, _ = run_copy
    assert main(["consolidate", str(out / "checkpoints" / "step-00000004"), str(read_only_dir / "model")]) == 2
    assert "read-only file system" in one_line(capsys.readouterr().err)


def test_output_dir_without_room_for_one_checkpoint(tmp_path, model_dirs, capsys, monkeypatch):
    from bigfit.outputs import rundir

    monkeypatch.setattr(rundir, "free_bytes", lambda path: 10_000)
    assert main(["train", "--model", str(model_dirs["t5"]), "--strategy", "single", "--output-dir",
                 str(tmp_path / "out")]) == 2
    line = one_line(capsys.readouterr().err)
    assert "0.00 GB free, but one checkpoint of this model takes" in line
    assert not (tmp_path / "out").exists()


def test_no_checkpoints_trains_without_room_for_one_and_writes_none(tmp_path, model_dirs, pairs_file, capsys,
                                                                      monkeypatch):
    """--no-checkpoints: a model whose states would not fit on the disk still trains; nothing is saved,
    so there is no model directory either, and the table says so."""
    from bigfit.outputs import rundir

    monkeypatch.setattr(rundir, "free_bytes", lambda path: 10_000)
    out = tmp_path / "out"
    assert main(["train", "--model", str(model_dirs["llama"]), "--data", str(pairs_file), "--strategy", "single",
                 "--max-steps", "2", "--batch-size", "2", "--eval-samples", "0", "--no-checkpoints",
                 "--output-dir", str(out)]) == 0
    assert "none (--no-checkpoints)" in " ".join(capsys.readouterr().out.split())
    assert len(read_jsonl(out / "metrics.jsonl")) == 2
    assert not (out / "checkpoints").exists() and not (out / "model").exists()


def test_a_model_marker_never_reaches_outside_its_directory(tmp_path):
    """--overwrite removes what bigfit-model.json lists: an edited marker cannot name another file, even
    with that file's true size and checksums."""
    from bigfit.outputs.manifest import describe
    from bigfit.outputs.records import MODEL_MARKER, model_record, split

    (tmp_path / "victim.txt").write_text("mine")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    victim = describe(tmp_path, ["victim.txt"])["victim.txt"]
    files = {**describe(model, ["config.json"]), "../victim.txt": victim, str(tmp_path / "victim.txt"): victim}
    (model / MODEL_MARKER).write_text(json.dumps({"files": files}))
    assert sorted(split(model, model_record(model), MODEL_MARKER, exact=True)[0]) == [model / "bigfit-model.json",
                                                                                       model / "config.json"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: the read-only mount above covers it")
def test_output_dir_without_write_permission(tmp_path, model_dirs, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert main(["train", "--model", str(model_dirs["t5"]), "--strategy", "single", "--output-dir",
                     str(locked / "out")]) == 2
    finally:
        locked.chmod(0o755)
    assert "is not writable by this user" in one_line(capsys.readouterr().err)


def test_a_directory_this_user_cannot_write_is_named(tmp_path, monkeypatch):
    """The same check where this user is root (os.access answers as for another user)."""
    from bigfit.errors import BigfitError
    from bigfit.outputs import rundir

    monkeypatch.setattr(rundir.os, "access", lambda path, mode: False)
    with pytest.raises(BigfitError, match=f"'{tmp_path}' is not writable by this user"):
        rundir.check_location(tmp_path / "out", "--output-dir")


def crash_while_claiming(out):
    """On each rank: rank 0's claim fails with a machine fault; returns what each rank raised."""
    import types

    from bigfit.common.distributed import init_runtime
    from bigfit.outputs import ownership

    def fault(*args):
        raise OSError(5, "Input/output error")

    real, ownership._own = ownership._own, fault
    try:
        with ownership.claim(types.SimpleNamespace(cfg=types.SimpleNamespace(output_dir=out)), init_runtime()):
            return "claimed"
    except BaseException as e:
        return f"{type(e).__name__}: {e}"
    finally:
        ownership._own = real


def test_a_fault_while_rank_0_claims_fails_every_rank_instead_of_hanging_them(tmp_path):
    from dist import run_ranks

    raised = run_ranks(crash_while_claiming, 2, str(tmp_path / "out"))
    assert raised[0] == "OSError: [Errno 5] Input/output error"
    assert raised[1] == f"RuntimeError: rank 0 failed while claiming {tmp_path / 'out'}: {raised[0]}"

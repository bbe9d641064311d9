"""Damaged checkpoints are found before anything is loaded: the manifest in COMPLETE (every file's
size and CRC-32) names what is wrong, and `--resume` and `consolidate` refuse with one line that names
the damaged checkpoint and the newest older intact one, never falling back to it silently, and
touching no file."""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from bigfit.cli import main
from conftest import one_line, snapshot

NEWEST, OLDER = "step-00000004", "step-00000002"


def resume(args, out, capsys) -> tuple[int, str]:
    code = main([*args, "--output-dir", str(out), "--resume", "--max-steps", "6"])
    return code, capsys.readouterr().err


def test_a_truncated_shard_names_the_checkpoint_the_file_and_the_older_intact_one(run_copy, capsys):
    out, args = run_copy
    shard = out / "checkpoints" / NEWEST / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    before = snapshot(out)
    code, err = resume(args, out, capsys)
    line = one_line(err)
    assert code == 2 and f"{NEWEST}' is damaged: __0_0.distcp has" in line
    assert f"the newest intact one is '{out / 'checkpoints' / OLDER}'" in line and "--resume" in line
    assert snapshot(out) == before


def test_a_truncated_trainer_json_is_found_too(run_copy, capsys):
    out, args = run_copy
    trainer = out / "checkpoints" / NEWEST / "trainer.json"
    trainer.write_text(trainer.read_text()[:40])
    code, err = resume(args, out, capsys)
    assert code == 2 and "trainer.json has" in one_line(err)


def test_a_newest_checkpoint_without_its_marker_is_never_skipped_silently(run_copy, capsys):
    out, args = run_copy
    (out / "checkpoints" / NEWEST / "COMPLETE").unlink()
    code, err = resume(args, out, capsys)
    line = one_line(err)
    assert code == 2 and f"{NEWEST}' is damaged: it has no COMPLETE marker" in line and OLDER in line


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line(run_copy, model_dirs, capsys):
    """Another architecture is refused by the settings check; forced past it, the load says so."""
    out, args = run_copy
    gpt2 = ["--model", str(model_dirs["gpt2"])]
    code, err = resume([*args, *gpt2], out, capsys)
    assert code == 2 and "--allow-changed" in one_line(err)
    code, err = resume([*args, *gpt2, "--allow-changed", "model"], out, capsys)
    assert code == 2 and "does not fit this single job" in one_line(err)


def corrupt(ckpt: Path, rng: random.Random) -> str:
    """One random kind of damage to one random file of `ckpt`; returns what was done."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    victim = rng.choice(files)
    kind = rng.choice(["truncate", "flip", "delete"])
    data = victim.read_bytes()
    if kind == "delete":
        victim.unlink()
    elif kind == "truncate":
        victim.write_bytes(data[:rng.randrange(len(data))])
    else:
        at = rng.randrange(len(data))
        victim.write_bytes(data[:at] + bytes([data[at] ^ rng.randrange(1, 256)]) + data[at + 1:])
    return f"{kind} {victim.name}"


def test_randomly_damaged_checkpoints_are_refused_in_one_line_and_nothing_is_touched(finished_run, tmp_path, capsys):
    """50 cases (a seeded sample of truncations, flipped bytes and deleted files in any file of the
    newest checkpoint, its marker included): `--resume` and `consolidate` each exit 2 with one line
    naming the checkpoint, and every file is byte-for-byte as it was."""
    out, args = finished_run
    rng = random.Random(1234)
    for case in range(50):
        copy = tmp_path / f"case-{case}"
        shutil.copytree(out, copy)
        what = corrupt(copy / "checkpoints" / NEWEST, rng)
        before = snapshot(copy)
        code, err = resume(args, copy, capsys)
        assert code == 2, what
        assert f"{NEWEST}' is damaged" in one_line(err), (what, err)
        code = main(["consolidate", str(copy / "checkpoints" / NEWEST), str(tmp_path / f"model-{case}")])
        assert code == 2, what
        assert f"{NEWEST}' is damaged" in one_line(capsys.readouterr().err), what
        assert snapshot(copy) == before, what
        assert not (tmp_path / f"model-{case}").exists()
        shutil.rmtree(copy)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_manifest_seal_finds_any_change_to_the_marker():
    from bigfit.outputs import manifest

    text = manifest.seal({"step": 4, "world_size": 2, "time": 1.5, "files": {"a": [3, [7]]}})
    assert manifest.unseal(text)["files"] == {"a": [3, [7]]}
    for at in range(len(text)):
        for xor in (1, 0x20, 0x80):
            damaged = text[:at] + chr(ord(text[at]) ^ xor) + text[at + 1:]
            assert manifest.unseal(damaged) is None, (at, xor)
    assert manifest.unseal('{"step": 2, "world_size": 1, "time": 0}') == {"step": 2, "world_size": 1, "time": 0}

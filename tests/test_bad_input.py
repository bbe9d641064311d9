"""User mistakes: a short error naming the bad value and what would be valid, exit status 2, no
traceback, before any work starts, and nothing already saved is touched."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bigfit.cli import main


def run(capsys, *argv) -> tuple[int, str]:
    code = main(["train", *argv])
    return code, capsys.readouterr().err


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"source": "a", "target": "b"}\n{"source": "a" "target": "b"}\n')
    (tmp_path / "notckpt").mkdir()
    (tmp_path / "conf.yaml").write_text("max_steps: 3\nbatchsize: 4\n")
    return tmp_path


CASES = [
    (["--strategy", "zero9"], "strategy 'zero9' is not valid; choose one of: single, ddp, zero1, zero2, zero3"),
    (["--precision", "fp8"], "precision 'fp8' is not valid; choose one of: fp32, bf16, fp16, auto"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--strategy", "zero2-offload", "--offload-grads", "gpu"],
     "--offload-grads 'gpu' is not valid; choose one of: host, device"),
    (["--nvme-host-gb", "8"], "--nvme-host-gb must be 0 or more and belongs to --strategy zero2-offload-nvme"),
    (["--max-steps", "-1"], "--max-steps must be a positive integer, got -1"),
    (["--model", "./no/such/model"], "--model './no/such/model' does not exist"),
    (["--data", "{d}/missing.jsonl"], "missing.jsonl' does not exist"),
    (["--data", "{d}/broken.jsonl"], "broken.jsonl' line 2 is not valid JSON"),
    (["--resume", "{d}/notckpt"], "notckpt' is not a complete bigfit checkpoint"),
    (["--resume"], "--resume: no complete checkpoint in"),
    (["--config", "{d}/conf.yaml"], "unknown setting(s) 'batchsize'"),
    (["--batch-size", "7", "--nproc", "2"], "--batch-size 7 is not divisible by the 2 data-parallel processes"),
    (["--model", "{d}"], "holds no config.json"),
    (["--model", "nobody/no-such-model"], "--model 'nobody/no-such-model' could not be loaded"),  # offline hub
]


@pytest.mark.parametrize("argv,needle", CASES, ids=[c[0][0] + ("=" + c[0][1] if len(c[0]) > 1 else "") for c in CASES])
def test_bad_input_is_one_clear_line(capsys, bad_files, argv, needle):
    argv = [a.replace("{d}", str(bad_files)) for a in argv]
    code, err = run(capsys, "--output-dir", str(bad_files / "out"), *argv)
    assert code == 2
    assert needle.replace("{d}", str(bad_files)) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (bad_files / "out").exists()  # nothing started


def test_bad_input_leaves_earlier_output_alone(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    code, err = run(capsys, "--output-dir", str(out), "--resume", str(tmp_path / "nope"))
    assert code == 2 and "nope" in err
    assert (out / "metrics.jsonl").read_text() == json.dumps({"step": 1, "loss": 1.0}) + "\n"


def test_command_line_process_exits_2_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bigfit", "train", "--strategy", "pipedream", "--output-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: strategy 'pipedream' is not valid")
    assert "Traceback" not in r.stderr


def test_consolidate_refuses_a_non_checkpoint(capsys, tmp_path):
    assert main(["consolidate", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "is not a complete bigfit checkpoint" in capsys.readouterr().err

"""The suite under any TMPDIR, rank pools that report a failure to send at once, and the evaluation's
progress line.

multiprocessing's AF_UNIX sockets live under TMPDIR and their paths hold 107 bytes: conftest.py keeps
its temporary root short (a short writable base where the user's TMPDIR leaves no room). A rank whose
result cannot be sent (it does not pickle; its tensors cannot be shared, as when that socket's path is
too long; the rank dies) is reported within seconds, naming the rank, not after the pool's timeout."""
from __future__ import annotations

import multiprocessing.connection
import os
import shutil
import tempfile
import time

import pytest
from conftest import SOCKET_PATH_MAX, nested_room, temp_root
from dist import DEATH_GRACE_S, run_ranks

from bigfit.training import metrics

REPORTED_WITHIN_S = DEATH_GRACE_S + 5.0  # the grace for the other ranks, and a loaded machine's slack


@pytest.mark.parametrize("length", [13, 60, 200])
def test_temp_root_leaves_sockets_room_whatever_tmpdir(length):
    tmpdir = "/" + "t" * (length - 1)  # need not exist: one too long is passed over, a missing one too
    root = temp_root(tmpdir)
    try:
        assert nested_room(os.path.dirname(root)) <= SOCKET_PATH_MAX, root
    finally:
        os.rmdir(root)


def test_temp_root_stays_in_a_short_tmpdir():
    short = tempfile.mkdtemp(dir="/tmp")
    try:
        assert os.path.dirname(temp_root(short)) == short
    finally:
        shutil.rmtree(short)


def test_this_process_can_make_multiprocessing_sockets():
    with multiprocessing.connection.Listener(family="AF_UNIX") as listener:  # what resource_sharer makes
        assert len(listener.address) <= SOCKET_PATH_MAX


def _ok() -> int:
    return 0


def _unpicklable_on_rank_1():
    import torch.distributed as dist

    return (lambda: 0) if dist.get_rank() == 1 else 0


def _rank_1_dies():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)
    time.sleep(60)  # busy elsewhere: it is the dead rank's silence that must end the wait


def _failure(fn) -> tuple[str, float]:
    run_ranks(_ok, 2)  # the pool started (or reused): its start is not what is timed
    began = time.monotonic()
    with pytest.raises(AssertionError) as caught:
        run_ranks(fn, 2, timeout_s=60)
    return str(caught.value), time.monotonic() - began


def test_a_result_that_cannot_be_sent_is_reported_at_once():
    text, took = _failure(_unpicklable_on_rank_1)
    assert took < REPORTED_WITHIN_S, (took, text)
    assert "--- rank 1 ---" in text and "could not be sent" in text and "pickle" in text, text
    assert "--- rank 0 ---" not in text, text


def test_a_rank_that_dies_is_reported_at_once():
    text, took = _failure(_rank_1_dies)
    assert took < REPORTED_WITHIN_S, (took, text)
    assert "--- rank 1 ---\ndied with exit code 7" in text, text
    assert f"still running {DEATH_GRACE_S:.0f}s after rank 1 died" in text, text


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_eval_progress_on_a_pipe_says_little(capsys):
    clock = _Clock()
    progress = metrics.EvalProgress(40, clock=clock)
    for done, at in [(8, 104.0), (16, 111.0), (24, 115.0), (32, 122.0), (40, 130.0)]:
        clock.now = at
        progress.update(done)
    progress.close()
    assert capsys.readouterr().out.splitlines() == ["eval 16/40 samples  11.0s", "eval 32/40 samples  22.0s"]


def test_eval_progress_below_the_training_bar(monkeypatch):
    import io

    from rich.console import Console

    out = io.StringIO()
    monkeypatch.setattr(metrics, "console", Console(file=out, force_terminal=True, width=100))
    train = metrics.StepProgress(0, 4)
    progress = metrics.EvalProgress(40)
    assert progress.bar is train.bar  # one live display: the evaluation is a row of the training bar
    progress.update(24)
    train.bar.refresh()
    progress.close()
    assert [t.description for t in train.bar.tasks] == ["train"]
    train.close()
    assert "24/40" in out.getvalue() and "samples" in out.getvalue()


def test_the_baseline_evaluation_shows_progress(model_dirs, pairs_file, tmp_path, monkeypatch, capsys):
    from bigfit.cli import main

    monkeypatch.setattr(metrics.EvalProgress, "PLAIN_EVERY_S", 0.0)  # a line at each batch
    assert main(["train", "--model", str(model_dirs["t5"]), "--data", str(pairs_file), "--strategy", "single",
                 "--max-steps", "1", "--batch-size", "4", "--eval-samples", "8", "--num-beams", "1",
                 "--max-new-tokens", "4", "--eval-every", "0", "--no-checkpoints", "--no-consolidate",
                 "--output-dir", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    baseline = lines[:next(i for i, line in enumerate(lines) if line.startswith("eval at step 0"))]
    said = [line.split("  ")[0] for line in baseline if line.startswith("eval ")]
    assert said == ["eval 4/8 samples", "eval 8/8 samples"], lines

"""--report-to: the steps' numbers in TensorBoard event files, an offline W&B run and an MLflow file
store, read back with each library's own reader and held to metrics.jsonl; mistakes one line first."""
from __future__ import annotations

import json
import struct

import pytest

from conftest import read_jsonl


def _train(model_dirs, pairs_file, out, *flags):
    from bigfit.cli import main

    return main(["train", "--model", str(model_dirs["t5"]), "--data", str(pairs_file), "--strategy", "single",
                 "--batch-size", "4", "--max-steps", "3", "--eval-every", "3", "--eval-samples", "4", "--num-beams", "1",
                 "--max-new-tokens", "4", "--save-every", "0", "--no-consolidate", "--output-dir", str(out), *flags])


@pytest.mark.parametrize("spec,needle", [
    ("tensorbord", "--report-to 'tensorbord': 'tensorbord' is no reporter; give a comma-separated list of tensorboard, "
                   "wandb, mlflow, or none"),
    ("wandb,comet", "'comet' is no reporter"),
])
def test_an_unknown_reporter_is_one_line_before_any_work(model_dirs, pairs_file, tmp_path, capsys, spec, needle):
    assert _train(model_dirs, pairs_file, tmp_path / "out", "--report-to", spec) == 2
    assert needle in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_reporter_whose_package_is_missing_names_the_extra(model_dirs, pairs_file, tmp_path, capsys, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find(name, *a))
    assert _train(model_dirs, pairs_file, tmp_path / "out", "--report-to", "tensorboard,mlflow") == 2
    assert "mlflow is not installed; pip install 'bigfit[tracking]' (or pip install mlflow)" in capsys.readouterr().err


def test_every_dashboard_gets_the_numbers_metrics_jsonl_holds(model_dirs, pairs_file, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "out"
    assert _train(model_dirs, pairs_file, out, "--report-to", "tensorboard,wandb,mlflow") == 0
    steps = read_jsonl(out / "metrics.jsonl")
    losses = [m["loss"] for m in steps]
    run_id = json.loads((out / "run.json").read_text())["run_id"]

    board = EventAccumulator(str(out / "runs" / run_id))
    board.Reload()
    assert [e.step for e in board.Scalars("train/loss")] == [1, 2, 3]
    assert [e.value for e in board.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)
    assert board.Scalars("eval/loss")[-1].value == pytest.approx(steps[-1]["eval_loss"], rel=1e-6)
    predicted = _planned_peak(model_dirs, pairs_file)  # the planner's row for this run's layout
    assert predicted > 0 and [e.value for e in board.Scalars("train/predicted_peak_gpu_gb")] == pytest.approx([predicted] * 3)

    client = mlflow.MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("bigfit").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(i + 1, pytest.approx(v, rel=1e-9)) for i, v in enumerate(losses)]
    assert run.data.params["strategy"] == "single" and run.info.run_name == run_id

    (offline,) = (out / "wandb").glob("offline-run-*/run-*.wandb")  # offline without an API key: `wandb sync` uploads it
    history = {r["_step"]: r for r in _wandb_history(offline)}
    assert [history[s].get("train/loss") for s in (1, 2, 3)] == pytest.approx(losses, rel=1e-9)
    assert history[3]["eval/loss"] == pytest.approx(steps[-1]["eval_loss"], rel=1e-9)


def _planned_peak(model_dirs, pairs_file) -> float:
    """The planner's peak for _train's run (on this machine: the CPU as the run's device), at its data's
    longest sample, as the run rates it."""
    from bigfit.settings.config import TrainConfig
    from bigfit.job.autoplan import predicted_peak_gb
    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import data_lengths

    cfg = resolve(TrainConfig(model=str(model_dirs["t5"]), data=str(pairs_file), strategy="single", batch_size=4), 1).cfg
    return predicted_peak_gb(cfg, 1, data_lengths(cfg))


def _wandb_history(path) -> list[dict]:
    """The history records of an offline W&B run file: LevelDB's log format (7-byte header, 32 KB blocks,
    records of checksum, length, type) holding wandb's protobuf Records; wandb 0.19+ reads it in Go only."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, part, rows = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or a split one's last piece
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows

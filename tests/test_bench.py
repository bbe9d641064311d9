"""`bigfit bench` (bigfit/bench/): its table and files from rows, a failed row among measured ones,
Ctrl-C keeping the rows so far, its one-line refusals, and real runs on the embedded tiny T5 on this
CPU: the probe's exact largest micro-batch (an injected out-of-memory above 16), a size the probe
confirmed that training cannot hold (trained at a smaller one, said in the row), and a method that
crashes becoming a row with its reason while the bench goes on."""
from __future__ import annotations

import csv
import json

import pytest

from conftest import bigfit, one_line

OK = {"method": "zero2 fp32", "strategy": "zero2", "precision": "fp32", "micro": 64, "batch": 128, "train_s": 1.5,
      "step_s": 0.37, "eval_s": 0.4, "bleu": 12.5, "ppl": 3.1, "tokens_per_s": 900.0, "tflops": 0.01,
      "host_rss_gb": 0.8, "predicted_micro": 80, "predicted_step_s": 0.3, "predicted_peak_gb": 1.1, "status": "ok",
      "reason": None}
OOM = {"method": "zero3 fp32", "strategy": "zero3", "precision": "fp32", "status": "exit 1",
       "reason": "torch.OutOfMemoryError: CUDA out of memory", "predicted_micro": 40}


def test_the_table_and_files_hold_every_row_failed_ones_with_their_reason(tmp_path):
    from bigfit.bench import report

    rows = [OK, OOM]
    assert report.cells(OK)[:5] == ["zero2 fp32", "64", "1.50", "0.40", "BLEU 12.5"]  # the seed's columns first
    assert report.cells(OOM)[1:5] == ["", "", "", ""] and report.cells(OOM)[-1] == "exit 1"
    said = report.recommendation(rows, "zero3")
    assert said == "fastest measured: zero2 fp32 (1.50 s to train, micro-batch 64); --strategy auto would pick zero3 instead"
    assert report.recommendation(rows, "zero2").endswith("--strategy auto picks it too (zero2)")
    assert report.recommendation([OOM], "zero2") == "no method ran to the end: nothing to recommend"
    paths = report.write(tmp_path, rows, {"model": "m", "recommendation": said})
    assert sorted(p.name for p in paths) == ["bench.csv", "bench.json", "bench.md", "bench.png"]
    md = (tmp_path / "bench.md").read_text()
    assert "| method | max BS | train s | eval s |" in md and "| zero3 fp32 |" in md and said in md
    table = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert [r["status"] for r in table] == ["ok", "exit 1"] and table[1]["reason"].startswith("torch.OutOfMemoryError")
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][1]["reason"] == OOM["reason"]


def test_ctrl_c_keeps_the_rows_measured_so_far(tmp_path, monkeypatch):
    from bigfit.bench import driver as command
    from bigfit.settings.bench import BenchSettings
    from bigfit.settings.config import TrainConfig

    calls = []

    def run_row(out, bench, base, strategy, precision):
        if calls:
            raise KeyboardInterrupt
        calls.append(strategy)
        return {**OK, "method": f"{strategy} {precision}", "strategy": strategy}

    _stub_bench(monkeypatch, run_row)
    out = tmp_path / "b"
    assert command.bench_command(BenchSettings(output_dir=str(out)), TrainConfig()) == 130
    saved = json.loads((out / "bench.json").read_text())
    assert [r["method"] for r in saved["rows"]] == ["ddp fp32"] and saved["interrupted"] == "Ctrl-C after 1 of 3 rows"
    assert "--strategy auto picks it too (ddp)" in saved["recommendation"]


def test_sigterm_is_ctrl_c_for_the_bench(tmp_path, monkeypatch):
    """SIGTERM (`timeout`, a scheduler's stop) stops the bench as Ctrl-C does: the row in flight is
    stopped with its processes, the rows so far kept, and the signal's handler put back after."""
    import os
    import signal

    from bigfit.bench import driver as command
    from bigfit.settings.bench import BenchSettings
    from bigfit.settings.config import TrainConfig

    def run_row(out, bench, base, strategy, precision):
        if strategy == "zero2":
            os.kill(os.getpid(), signal.SIGTERM)
        return {**OK, "method": f"{strategy} {precision}", "strategy": strategy}

    _stub_bench(monkeypatch, run_row)
    before = signal.getsignal(signal.SIGTERM)
    assert command.bench_command(BenchSettings(output_dir=str(tmp_path / "b")), TrainConfig()) == 130
    saved = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert [r["method"] for r in saved["rows"]] == ["ddp fp32"] and saved["interrupted"] == "SIGTERM after 1 of 3 rows"
    assert signal.getsignal(signal.SIGTERM) is before


def _stub_bench(monkeypatch, run_row) -> None:
    """bench_command over three stub rows (ddp, zero2, zero3 in fp32) that `run_row` measures."""
    from bigfit.bench import driver as command

    monkeypatch.setattr(command, "_rows", lambda bench, base, lengths: [("ddp", "fp32"), ("zero2", "fp32"), ("zero3", "fp32")])
    monkeypatch.setattr(command, "_auto_pick", lambda base, names, lengths: ("ddp", "planned"))
    monkeypatch.setattr(command, "_host_figure", lambda: {"host_op_us": 20.0})
    monkeypatch.setattr(command, "_run_row", run_row)


@pytest.mark.parametrize("argv,message", [
    (["--strategies", "zero4"], "error: --strategies 'zero4': zero4; valid: auto, all, or a list of "),
    (["--precisions", "fp8"], "error: --precisions 'fp8': fp8; valid: fp32, bf16, fp16"),
    (["--train-samples", "0"], "error: --train-samples must be positive, got 0"),
    (["--max-steps", "3"], "error: unrecognized arguments: --max-steps 3; "),
])
def test_bench_refuses_bad_input_in_one_line(tmp_path, capsys, argv, message):
    code, printed = _bench(capsys, "--output-dir", tmp_path / "b", *argv)
    assert code == 2 and one_line(printed.err).startswith(message), printed.err
    assert not (tmp_path / "b" / "rows").exists()  # refused before any row ran


def _bench(capsys, *argv):
    """`bigfit bench ARGV` in this process (its rows are processes of their own): exit status and
    what it printed (.out, .err)."""
    from bigfit.cli import main

    try:
        code = main(["bench", *map(str, argv)])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr()


def test_bench_never_replaces_a_directory_it_did_not_write(tmp_path, capsys):
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        code, printed = _bench(capsys, "--output-dir", mine, *extra)
        assert code == 2 and "is not empty (it is not a bench directory)" in one_line(printed.err)
    assert (mine / "notes.txt").read_text() == "mine"


def test_bench_overwrite_removes_its_own_files_only(tmp_path, capsys):
    from bigfit.bench.driver import _claim

    out, elsewhere = tmp_path / "b", tmp_path / "elsewhere"
    (out / "rows" / "single-fp32").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (out / "rows" / "single-fp32" / "link").symlink_to(elsewhere)
    for name in ("bench.json", "bench.md", "notes.txt"):
        (out / name).write_text(name)
    assert _claim(out, overwrite=True) == out
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (elsewhere / "keep.txt").read_text() == "mine"
    assert "kept notes.txt" in capsys.readouterr().out


def test_a_real_bench_finds_the_exact_largest_micro_batch_and_keeps_a_crashed_method_as_a_row(tmp_path, capsys,
                                                                                            monkeypatch):
    """`bigfit bench` in this process (its rows are processes of their own, which inherit the fault)."""
    small = ["--strategies", "single", "--train-samples", "64", "--eval-samples", "8", "--num-beams", "2",
             "--max-new-tokens", "4", "--untimed-steps", "1"]
    # the probe's OOM above 16, and training's above 15: a size the probe confirmed that a whole run cannot
    # hold, so the row trains at the next size below and says so
    monkeypatch.setenv("BIGFIT_FAULT", "oom-above:16:15")
    _keep_calibration(tmp_path / "cache", monkeypatch, host_op_us=7.5)  # the rows' processes read it too
    code, printed = _bench(capsys, "--output-dir", tmp_path / "b", *small)
    assert code == 0
    saved = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert saved["host_op_us"] == 7.5 and saved["host_op_us_from"].startswith("kept in ")
    (row,) = saved["rows"]
    assert row["status"] == "ok" and row["oom_in_training"] == [16], row  # exact, not a power of two's guess
    micro = row["micro"]
    assert micro <= 15 and row["batch"] == micro
    said = f"micro-batch 16 ran out of memory in training after the probe confirmed it; trained at {micro}"
    assert row["reason"] == said and said in " ".join(printed.out.split()) and said in (tmp_path / "b" / "bench.md").read_text()
    assert row["train_s"] == pytest.approx(row["step_s"] * 64 / micro, rel=0.01, abs=0.001) and row["eval_s"] > 0
    assert row["bleu"] is not None and row["predicted_micro"] >= 16 and row["predicted_step_s"] > 0
    assert "fastest measured: single fp32" in printed.out and (tmp_path / "b" / "bench.png").is_file()
    # a method that crashes (here in its probe, the row's first work: the cheapest crash to wait for)
    monkeypatch.setenv("BIGFIT_FAULT", "probe:0:0:raise")
    code, printed = _bench(capsys, "--output-dir", tmp_path / "c", *small)
    assert code == 0 and "no method ran to the end" in printed.out
    (row,) = json.loads((tmp_path / "c" / "bench.json").read_text())["rows"]
    assert row["status"] != "ok" and "injected fault at probe 0" in row["reason"], row


def _keep_calibration(cache, monkeypatch, **record) -> None:
    """A kept `bigfit plan --calibrate` record for this machine's jobs on the CPU."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    (cache / "bigfit").mkdir(parents=True)
    (cache / "bigfit" / "host.json").write_text(json.dumps({"cpu": record}))


def test_the_bench_rates_this_host_calibrating_it_first_where_nothing_is_kept(tmp_path, capsys, monkeypatch):
    from bigfit.bench import driver as command
    from bigfit.commands import calibrate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "none"))
    monkeypatch.setattr(calibrate, "calibrate", lambda: {"host_op_us": 12.345})  # the real one: test_hostcost
    assert command._host_figure() == {"host_op_us": 12.35, "host_op_us_from": "measured at the bench's start"}
    assert "calibrating this host for the predictions" in capsys.readouterr().out
    _keep_calibration(tmp_path / "kept", monkeypatch, host_op_us=30.0)
    assert command._host_figure()["host_op_us"] == 30.0 and not capsys.readouterr().out  # kept: not measured again


def test_after_an_out_of_memory_in_training_the_row_tries_smaller_sizes_the_probe_confirmed_first():
    from bigfit.bench.rows import _smaller
    from bigfit.planning.sizes import ProbeSearch

    search = ProbeSearch(16, list(range(1, 33)), [[16, True, None], [24, False, None], [20, True, None],
                                                  [22, False, None], [21, True, None]])
    assert _smaller(search, 21) == [20, 18]  # the next confirmed, then a tenth below (none confirmed there)
    assert _smaller(ProbeSearch(8, [4, 8, 16], [[8, True, None]]), 8) == [4]
    assert _smaller(ProbeSearch(1, [1, 2], [[1, True, None]]), 1) == []


def test_max_train_samples_keeps_the_first_samples_after_the_held_out_ones(tmp_path):
    from bigfit.settings.config import TrainConfig
    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import prepare

    def dataset(**kw):
        return prepare(resolve(TrainConfig(output_dir=str(tmp_path), batch_size=8, eval_samples=16, **kw), 1)).dataset

    whole, first = dataset(), dataset(max_train_samples=40)
    assert len(first.train) == 40 and first.train == whole.train[:40] and first.eval == whole.eval
    r = bigfit("train", "--output-dir", tmp_path / "o", "--batch-size", "8", "--max-train-samples", "4")
    assert r.returncode == 2 and one_line(r.stderr) == ("error: --max-train-samples must be at least the global "
                                                        "batch (8), got 4")


def test_runs_split_by_a_time_limit_merge_into_one_table_with_the_peers_rated_alike(tmp_path):
    """benchmarks/bench_merge.py: a later run's row replaces an earlier failed one (never an ok one
    by a failed one), and a peer's tokens/s is the bench's trained tokens a sample at its step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from bench_merge import merged

    first = {"rows": [OK, OOM]}
    later = {"rows": [{**OOM, "status": "ok", "micro": 40, "batch": 40, "train_s": 2.0, "step_s": 0.2,
                       "tokens_per_s": 400.0, "tflops": 0.02, "reason": None}, {**OK, "status": "timeout"}]}
    peer = {"method": "ds-z2-offload", "micro": 32, "step_s": 0.5, "train_s": 2.1, "eval_s": 0.3, "bleu": 1.0}
    rows = merged([first, later], [[peer, {"method": "ds-z2", "error": "no micro-batch ran: boom"}]])
    assert [r["method"] for r in rows] == ["zero2 fp32", "zero3 fp32", "DeepSpeed ZeRO-2 offload (peer)",
                                           "DeepSpeed ZeRO-2 (peer)"]
    assert rows[0]["status"] == "ok" and rows[1]["status"] == "ok" and rows[1]["micro"] == 40
    per_sample = (900.0 * 0.37 / 128 + 400.0 * 0.2 / 40) / 2  # the median of the two ok rows: their mean
    assert rows[2]["tokens_per_s"] == pytest.approx(32 * per_sample / 0.5, rel=1e-3)
    assert rows[3]["status"] == "error" and rows[3]["reason"] == "no micro-batch ran: boom"


def test_a_merged_table_weighs_the_pick_among_every_runs_strategies_against_the_fastest(tmp_path, monkeypatch):
    """Each run's own auto pick covers its strategies alone; the one named with --auto-pick (asked on
    the machine over all of them) is what the merged recommendation weighs."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import bench_merge

    runs = []
    for i, (row, pick) in enumerate([(OK, "zero2"), ({**OK, "method": "zero3 fp32", "strategy": "zero3",
                                                       "train_s": 1.2}, "zero3")]):
        runs.append(tmp_path / f"run{i}.json")
        runs[-1].write_text(json.dumps({"model": "m", "started": f"t{i}", "auto_pick": pick, "rows": [row]}))
    monkeypatch.setattr(sys, "argv", ["bench_merge.py", *map(str, runs), "--out", str(tmp_path / "table"),
                                      "--auto-pick", "zero2"])
    bench_merge.main()
    md = (tmp_path / "table" / "bench.md").read_text()
    assert "among its own strategies: t0 zero2; t1 zero3" in md
    assert "fastest measured: zero3 fp32 (1.20 s to train, micro-batch 64); --strategy auto would pick zero2 instead" in md

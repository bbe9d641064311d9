"""`bigfit bench`: which strategy x precision rows to run (the planner's, or the user's), each in a row
process of its own (rows.py) with a time limit, a progress display over the whole bench with the
time left, then the table and files (report.py). A row that fails or runs out of memory is a row
with its reason; Ctrl-C (or SIGTERM) stops the row in flight and keeps the rows measured so far."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich import box
from rich.table import Table

from ..common.processes import interrupt_name, stop_on_sigterm
from ..errors import BigfitError
from ..settings.bench import BenchSettings
from ..settings.config import PIPELINE_STRATEGIES, PRECISIONS, SPLIT_STRATEGIES, STRATEGIES, TrainConfig
from ..training.metrics import console
from . import report
from .rows import collect

BENCH_FILES = ("bench.json", "bench.md", "bench.csv", "bench.png")  # report.py's, beside the rows/ folder
ONE_GPU_SAME = ("ddp", "zero1")  # on one process these are the plain model: single's row already


def bench_command(bench: BenchSettings, base: TrainConfig) -> int:
    from ..job.prepare import data_lengths

    lengths = data_lengths(base)  # the planner's rows rate the data's longest batch, not the length limits
    todo = _rows(bench, base, lengths)  # every mistake in the lists before the directory is touched
    out = _claim(Path(bench.output_dir), bench.overwrite)
    rows, meta = [], {"model": base.model or "embedded tiny T5", "data": base.data or "embedded task",
                      "train_samples": bench.train_samples, "eval_samples": base.eval_samples,
                      "num_beams": base.num_beams, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    meta.update(_host_figure())  # before the pick and the rows: their predicted step times rate this host
    meta["auto_pick"], meta["auto_reason"] = _auto_pick(base, {s for s, _ in todo}, lengths)
    try:
        with stop_on_sigterm(), Progress(TextColumn("{task.description}"), BarColumn(),
                                         TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                         TextColumn("left"), TimeRemainingColumn(), console=console) as bar:
            task = bar.add_task("bench", total=len(todo))
            for strategy, precision in todo:
                bar.update(task, description=f"{strategy} {precision}")
                rows.append(_run_row(out, bench, base, strategy, precision))
                report.write(out, rows, {**meta, "recommendation": report.recommendation(rows, meta["auto_pick"])})
                bar.advance(task)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`timeout`, a scheduler): the row's processes are stopped
        meta["interrupted"] = f"{interrupt_name(e)} after {len(rows)} of {len(todo)} rows"
    meta["recommendation"] = report.recommendation(rows, meta["auto_pick"])
    _show(rows, meta)
    for p in report.write(out, rows, meta):  # after each row too: a bench cut short keeps its rows
        console.print(f"wrote {p}")
    return 130 if "interrupted" in meta else 0


def _claim(out: Path, overwrite: bool) -> Path:
    """The bench's directory: new or empty, or (--overwrite) one that holds a bench bigfit wrote."""
    if out.exists() and any(out.iterdir()):
        if not (overwrite and (out / "bench.json").is_file()):
            why = "--overwrite replaces it" if (out / "bench.json").is_file() else "it is not a bench directory"
            raise BigfitError(f"--output-dir {out} is not empty ({why}); give a new --output-dir")
        _remove_bench(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _remove_bench(out: Path) -> None:
    """The bench's own files in `out` (its reports and its rows/ folder, a link there removed as a link);
    the user's other files stay, and are named."""
    for name in BENCH_FILES:
        (out / name).unlink(missing_ok=True)
    rows = out / "rows"
    if rows.is_symlink():
        rows.unlink()
    elif rows.is_dir():
        shutil.rmtree(rows)  # made whole by the bench: a row's process and its runs (rmtree removes links as links)
    if kept := sorted(p.name for p in out.iterdir()):
        print(f"--overwrite: kept {', '.join(kept)} in {out} (not the bench's files)")


def _rows(bench: BenchSettings, base: TrainConfig, lengths: tuple[int, int]) -> list[tuple[str, str]]:
    precisions = _precisions(bench.precisions)
    names = _strategies(bench.strategies, dataclasses.replace(base, precision=precisions[0]), lengths)
    return [(s, p) for p in precisions for s in names]


def _precisions(text: str | None) -> list[str]:
    if text is None:
        import torch

        return ["bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"]
    out = [p.strip() for p in text.split(",") if p.strip()]
    if bad := [p for p in out if p not in PRECISIONS] or not out:
        raise BigfitError(f"--precisions {text!r}: {', '.join(bad) or 'none given'}; valid: {', '.join(PRECISIONS)}")
    return out


def _runnable(processes: int) -> tuple[str, ...]:
    """Every strategy whose largest micro-batch the probe can find with this many processes: ddp and
    zero1 on one are single's row again; pipelines are left out (the probe runs data-parallel shares,
    not stages: a pipeline named in --strategies is a row saying so)."""
    return tuple(s for s in STRATEGIES + SPLIT_STRATEGIES if processes > 1 or s not in ONE_GPU_SAME)


def _strategies(text: str, base: TrainConfig, lengths: tuple[int, int]) -> list[str]:
    from ..job.autoplan import default_processes

    every = _runnable(base.nproc or default_processes(dataclasses.replace(base, strategy="zero3")))
    if text == "all":
        return list(every)
    if text == "auto":  # the planner's: those predicted to fit here at one sample a process
        import torch

        from ..job.autoplan import plan_here

        if not torch.cuda.is_available():  # offload tiers and a map onto the host are for a GPU's memory
            every = tuple(s for s in every if "offload" not in s and s not in SPLIT_STRATEGIES)
        fits = set()
        for world in {_world(base, s) for s in every}:  # single and device_map: one process; the rest, each's
            p = plan_here(dataclasses.replace(base, batch_size="auto", micro_batch_size="auto"), world,
                          tuple(s for s in every if _world(base, s) == world), lengths)
            fits |= {c.estimate.name for c in p.candidates if c.fits}
        return [s for s in every if s in fits]
    names = [s.strip() for s in text.split(",") if s.strip()]
    if bad := [s for s in names if s not in STRATEGIES + SPLIT_STRATEGIES + PIPELINE_STRATEGIES] or not names:
        raise BigfitError(f"--strategies {text!r}: {', '.join(bad) or 'none given'}; valid: auto, all, or a list of "
                          f"{', '.join(every)}")
    return names


def _world(base: TrainConfig, strategy: str) -> int:
    from ..job.autoplan import default_processes

    return base.nproc or default_processes(dataclasses.replace(base, strategy=strategy))


def _host_figure() -> dict:
    """The host's cost per operator issued that the predictions use: this machine's kept calibration,
    else measured now (`bigfit plan --calibrate`, seconds) and kept. At small micro-batches a step is the
    host's issuing, which differs between machines by 25% and more (docs/planning.md); the rows'
    processes read the kept figure (hardware.detect)."""
    import torch

    from ..machine.hardware import calibrated_host_op_us, calibration_path

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if (kept := calibrated_host_op_us(device)) is not None:
        return {"host_op_us": round(kept, 2), "host_op_us_from": f"kept in {calibration_path()}"}
    from ..commands.calibrate import calibrate

    console.print("calibrating this host for the predictions (bigfit plan --calibrate; kept for the next runs)")
    return {"host_op_us": round(calibrate()["host_op_us"], 2), "host_op_us_from": "measured at the bench's start"}


def _auto_pick(base: TrainConfig, strategies: set[str], lengths: tuple[int, int]) -> tuple[str | None, str]:
    """What `--strategy auto --batch-size auto` would pick among the strategies benched, and why."""
    from ..job.autoplan import auto_named

    named = tuple(s for s in STRATEGIES + SPLIT_STRATEGIES if s in strategies)
    try:
        return auto_named(dataclasses.replace(base, batch_size="auto", micro_batch_size="auto"),
                          _world(base, "zero3"), named, lengths)
    except BigfitError as e:
        return None, str(e)


def _run_row(out: Path, bench: BenchSettings, base: TrainConfig, strategy: str, precision: str) -> dict:
    name = f"{strategy}-{precision}"
    row = out / "rows" / name
    row.mkdir(parents=True)
    cfg = dataclasses.replace(base, strategy=strategy, precision=precision, batch_size="auto", micro_batch_size="auto",
                              output_dir=str(row / "probe"), max_train_samples=bench.train_samples,
                              eval_on_start=False, checkpoints=False, consolidate=False, report_to="none",
                              device_map="auto" if strategy in SPLIT_STRATEGIES else base.device_map)
    spec = {"row_dir": str(row), "nproc": _world(base, strategy), "train": cfg.to_dict(),
            "samples": bench.train_samples, "warmup": bench.untimed_steps}
    (row / "spec.json").write_text(json.dumps(spec, indent=1))
    status = _wait(row, bench.row_timeout_s)
    found = collect(row, bench.untimed_steps, bench.train_samples)
    ok = status == "ok" and found.get("exit") == 0 and found.get("train_s") is not None
    return {"method": f"{strategy} {precision}", "strategy": strategy, "precision": precision, **found,
            "status": "ok" if ok else status if status != "ok" else "failed",
            "reason": _retried(found) if ok else _reason(row, found, status)}


def _retried(found: dict) -> str | None:
    """An ok row's note where training ran out of memory at sizes its probe had confirmed."""
    if not found.get("oom_in_training"):
        return None
    sizes = ", ".join(map(str, found["oom_in_training"]))
    return f"micro-batch {sizes} ran out of memory in training after the probe confirmed it; trained at {found['micro']}"


def _wait(row: Path, timeout: float) -> str:
    """Run the row's process (in a process group of its own, so that its workers go with it); "ok",
    "timeout" or "exit N". Ctrl-C stops it, then goes on up."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(row / "row.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bigfit.bench.rows", str(row / "spec.json")], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return "timeout"
        except KeyboardInterrupt:
            _stop(proc)
            raise
    return "ok" if code == 0 else f"exit {code}"


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _reason(row: Path, found: dict, status: str) -> str:
    """Why a row has no figures: its refusal, out of memory, its time limit, else its log's last error."""
    if found.get("error"):
        return found["error"]
    if status == "timeout":
        return "stopped at its time limit (--row-timeout-s)"
    lines = (row / "row.log").read_text(errors="replace").splitlines() if (row / "row.log").is_file() else []
    hits = [line.strip() for line in lines if "error" in line.lower() or "out of memory" in line.lower()]
    return (hits[-1] if hits else lines[-1].strip() if lines else status)[:300]


def _show(rows: list[dict], meta: dict) -> None:
    t = Table(title="bigfit bench", box=box.SIMPLE_HEAD)
    shown = [i for i, (key, _, _) in enumerate(report.COLUMNS) if key in report.TERMINAL]
    for i in shown:
        t.add_column(report.COLUMNS[i][1], no_wrap=True)
    for r in rows:
        c = report.cells(r)
        t.add_row(*(c[i] for i in shown))
    Console(highlight=False, width=max(console.width, 170)).print(t)  # narrow or piped: one line a row all the same
    for r in rows:
        if r.get("reason"):
            console.print(f"{r['method']}: {r['status']}: {r['reason']}")
    console.print(f"[bold]{meta['recommendation']}[/bold]")
    if meta.get("interrupted"):
        console.print(f"[yellow]{meta['interrupted']}: the rows above are those measured[/yellow]")

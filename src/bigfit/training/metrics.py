"""What the user sees and keeps: metrics.jsonl (one object per step), a progress bar with loss and
throughput, and tables. Only rank 0 writes or prints."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..common.processes import LAUNCHED_ENV, STARTED_ENV

console = Console(highlight=False)


class MetricsLog:
    """A JSONL log: OUTPUT/metrics.jsonl (one record per step: loss, lr, grad norm, tokens/s, peak GPU memory and the allocator's cache flushes so far on CUDA, the
    evaluation at steps that have one, and with step 1 StartClock's phases) or OUTPUT/eval.jsonl (every evaluation, step 0's too). On resume from step s, records after s are dropped first (they belong to
    the interrupted run and are about to be logged again)."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        kept = []
        if resume_step is not None and path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
        self._f = path.open("a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def allocator_flushes(device) -> int:
    """The GPU allocator's cache flushes on `device` so far (`num_alloc_retries`), read from the nested
    stats: torch.cuda.memory_stats flattens and sorts every entry first, work this does once a step."""
    import torch

    return torch.cuda.memory_stats_as_nested_dict(device).get("num_alloc_retries", 0)


class FlushWatch:
    """The GPU allocator's cache flushes during training, as DeepSpeed warns of them: a cudaMalloc that
    failed, every cached block freed (synchronizing the device) and the allocation retried. Steps that
    keep needing one run at a fraction of their speed (T5-large under zero2-offload on an H100: 1.06-1.31 s
    at micro-batch 192, 0.53 s at 160, 2026-12-06). `read()` gives the count so far; each step's record
    gets it, and the first flush after the first two steps (which make the optimizer states) is said once."""

    def __init__(self, read):
        self.read, self.seen, self.said = read, read(), False

    def update(self, record: dict, step: int, micro: int) -> str | None:
        now = self.read()
        new, self.seen = now - self.seen, now
        record["allocator_flushes"] = now
        if not new or step <= 2 or self.said:
            return None
        self.said = True
        return (f"step {step}: the GPU allocator flushed its cache {new} time(s) (memory near the card's limit); "
                f"steps that keep needing it run far slower: a micro-batch below {micro} may train faster "
                "(--micro-batch-size auto leaves such sizes out)")


class StartClock:
    """Where the time to the first step goes, phase by phase (wall seconds): the command before its
    workers (checks, micro-batch probes), the worker's start (imports), then each mark the loop makes
    (data, model, placement, optimizer, first step). Logged with step 1 and printed in one line."""

    def __init__(self):
        now = time.time()
        started, launched = float(os.environ.get(STARTED_ENV, now)), os.environ.get(LAUNCHED_ENV)
        self.phases = ({"command": now - started} if launched is None else
                       {"command": float(launched) - started, "worker start": now - float(launched)})
        self.last = now

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases[phase] = now - self.last
        self.last = now

    def record(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in self.phases.items()}

    def line(self) -> str:
        phases = self.record()  # the figures metrics.jsonl holds
        parts = ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
        return f"first step {sum(phases.values()):.1f} s after the command started: {parts}"


def _bar(transient: bool) -> Progress:
    """A live bar whose rows name themselves: training's, and an evaluation's below it."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                    transient=transient)


_shown: list[Progress] = []  # the training bar while it is live: an evaluation then adds a row to it


class StepProgress:
    """A live bar on a terminal; on a pipe (CI, logs) a plain line every tenth of the run instead."""

    def __init__(self, start: int, total: int):
        self.total, self.live = total, console.is_terminal
        self.every = max(1, total // 10)
        self.t0, self.start = time.perf_counter(), start
        if self.live:
            self.bar = _bar(transient=False)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()
            _shown.append(self.bar)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        info = f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
        if self.live:
            self.bar.update(self.task, completed=step, info=info)
        elif step % self.every == 0 or step == self.total:
            console.print(f"step {step}/{self.total}  {info}  {time.perf_counter() - self.t0:.1f}s")
            sys.stdout.flush()

    def print(self, text: str) -> None:
        (self.bar.console if self.live else console).print(text)

    def close(self) -> None:
        if self.live:
            self.bar.stop()
            _shown.remove(self.bar)


class EvalProgress:
    """Held-out samples evaluated so far, for the wait an evaluation is (before the first step, the
    baseline's beam search took 31 s of a 120 s start under load, with nothing shown): on a terminal a
    row updated in place (below the training bar while that is live), gone when the evaluation ends; on
    a pipe a plain line every PLAIN_EVERY_S, none for an evaluation shorter than that."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, total: int, clock=time.perf_counter):
        self.total, self.live, self.clock = total, console.is_terminal, clock
        self.t0 = self.said = clock()
        if self.live:
            self.bar = _shown[-1] if _shown else _bar(transient=True)
            self.task = self.bar.add_task("eval", total=total, info="samples")
            if not _shown:
                self.bar.start()

    def update(self, done: int) -> None:
        if self.live:
            self.bar.update(self.task, completed=done)
        elif (now := self.clock()) - self.said >= self.PLAIN_EVERY_S:
            self.said = now
            console.print(f"eval {done}/{self.total} samples  {now - self.t0:.1f}s")
            sys.stdout.flush()

    def close(self) -> None:
        if self.live:
            self.bar.remove_task(self.task)
            if self.bar in _shown:
                self.bar.refresh()  # else the next line printed above the bar shows the row's last frame again
            else:
                self.bar.stop()


def stop_live() -> None:
    """Stop the training bar where it is still live (an interrupt or an error ends the loop before it
    closes it) and give the terminal its cursor back, which a live bar hides until it stops: after a
    Ctrl-C the bar was drawn again below the message, and the shell left without a cursor."""
    while _shown:
        _shown.pop().stop()
    if console.is_terminal:
        console.show_cursor(True)


def table(title: str, rows: list[tuple[str, object]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows:
        t.add_row(k, escape(str(v)))  # values may hold brackets, which rich would read as markup
    return t

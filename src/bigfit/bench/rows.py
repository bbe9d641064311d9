"""One row of `bigfit bench`: a process of its own (`python -m bigfit.bench.rows SPEC`), so that a
strategy that crashes, runs out of memory or hangs ends its row, never the bench. It probes the
largest micro-batch that runs (commands/autobatch.py: worker sets of its own, the model built once per set),
then trains on --train-samples samples (--max-train-samples) at it, after the untimed steps, for as
many steps as they make (at least MIN_TIMED), and evaluates once at the end, all through `bigfit
train`'s own code (commands/train.py), in ROW/probe and ROW/train; where training runs out of
memory at the probe's size, again below it (RETRIES times at most; the row says so). Its train time
is the median timed step x samples / global batch. What it learns goes to ROW/row.json as it learns it, so a row
cut short keeps what it measured; `collect` reads that, metrics.jsonl and eval.jsonl back into one
flat record."""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

from ..training.probefile import OOM_EXIT, out_of_memory

ROW_FILE = "row.json"
RETRIES = 2  # smaller confirmed sizes tried after training ran out of memory at the probe's largest
MIN_TIMED = 3  # timed steps at least, for a median, where --train-samples is one or two batches


def run(spec: dict) -> int:
    """Probe, predict, train; returns `bigfit train`'s exit status (2: a refused setting)."""
    from ..commands.autobatch import choose_micro_batch
    from ..job.checks import validate
    from ..settings.config import TrainConfig
    from ..errors import BigfitError
    from ..job.autoplan import auto_micro_batch
    from ..training.probefile import load, path
    from ..job.prepare import data_lengths

    row, nproc = Path(spec["row_dir"]), spec["nproc"]
    cfg = TrainConfig(**spec["train"])
    found: dict = {}
    try:
        validate(cfg)
        lengths = data_lengths(cfg)  # planned at the data's longest batch, as `bigfit train` plans
        pred = auto_micro_batch(cfg, nproc, lengths)
        # the planner's time to train the samples at its predicted largest micro-batch: a method's own
        # figure of merit in a bench, where each runs at the largest batch it holds
        found.update(predicted_micro=pred.size, predicted_micro_gb=round(pred.need / 1e9, 2),
                     predicted_train_s=round(pred.step_s * spec["samples"] / (pred.size * nproc), 3))
        _write(row, found)
        with _bench_owned(cfg):  # ROW/probe is the bench's: its workers claim nothing there
            cfg = choose_micro_batch(["train"], cfg, nproc, speaks=True, pred=pred, lengths=lengths)  # not planned twice
        code = _train(row, cfg, nproc, spec, load(path(cfg.output_dir)), found, lengths)
    except BigfitError as e:
        found["error"] = str(e)
        code = 2
    _write(row, {**found, "exit": code})
    return code


def _bench_owned(cfg):
    """The probe's output directory as one its launcher claimed: it lies in the bench's own --output-dir,
    which the bench claimed, and `bigfit train` claims its directory before its probe writes there, so a
    worker's claim would find the probe's logs in the way."""
    from ..outputs.ownership import claimed, output_path

    return claimed(output_path(cfg))


def _train(row: Path, cfg, nproc: int, spec: dict, search, found: dict, lengths: tuple[int, int]) -> int:
    """Train at the probe's size; where that runs out of memory over a whole run, at smaller ones."""
    tries = [cfg.micro_batch_size] + _smaller(search, cfg.micro_batch_size)
    for i, micro in enumerate(tries):
        code = _train_at(row, cfg, nproc, spec, micro, search.peak(micro), found, lengths)
        if code != OOM_EXIT:
            return code
        found["oom_in_training"] = found.get("oom_in_training", []) + [micro]
        if i + 1 < len(tries):
            print(f"bench: micro-batch {micro} ran out of memory in training; again at {tries[i + 1]}", flush=True)
            shutil.rmtree(row / "train", ignore_errors=True)  # the failed attempt's (this bench's own directory)
    found["error"] = f"out of memory in training at micro-batch {', '.join(map(str, tries))} (the probe confirmed {tries[0]})"
    return code


def _smaller(search, micro: int) -> list[int]:
    """What to train at after a size the probe confirmed ran out of memory over a whole run (batches
    of other lengths, the allocator's fragments): the next sizes below it that the probe confirmed,
    and the largest allowed size a tenth below it (the search may have confirmed none below)."""
    tenth = [s for s in search.sizes if s <= 0.9 * micro]
    below = {s for s in search.ran() if s < micro} | set(tenth[-1:])
    return sorted(below, reverse=True)[:RETRIES]


def _train_at(row: Path, cfg, nproc: int, spec: dict, micro: int, peak: int | None, found: dict,
              lengths: tuple[int, int]) -> int:
    """Train the row at `micro` (one micro-batch a process), its plan beside it in `found`; the exit
    status, OOM_EXIT where one process (this one, or a worker) ran out of memory."""
    import torch

    from ..job.autoplan import plan_here
    from ..commands.train import train_command

    batch = micro * nproc
    steps = spec["warmup"] + max(MIN_TIMED, math.ceil(spec["samples"] / batch))
    job = dataclasses.replace(cfg, micro_batch_size=micro, batch_size=batch, max_steps=steps, eval_every=steps,
                              output_dir=str(row / "train"), probe_only=False)
    plan = plan_here(job, nproc, (job.strategy,), lengths)
    e = plan.candidates[0].estimate
    found.update(params=plan.params, micro=micro, batch=batch, steps=steps, probe_peak_gb=peak and round(peak / 1e9, 2),
                 predicted_step_s=round(e.step_time_s, 4), predicted_peak_gb=round(e.per_gpu["total"] / 1e9, 2))
    _write(row, found)
    try:
        return train_command(["train"], job)
    except RuntimeError as err:  # one process: training ran here
        if not out_of_memory(err):
            raise
    gc.collect()  # the failed step's tensors went with the exception's frames
    torch.cuda.empty_cache()
    return OOM_EXIT


def _write(row: Path, found: dict) -> None:
    tmp = row / (ROW_FILE + ".tmp")
    tmp.write_text(json.dumps(found, indent=1))
    tmp.replace(row / ROW_FILE)


def collect(row: Path, warmup: int, samples: int) -> dict:
    """What a row measured: its row.json, the median step after the warm-up (tokens over tokens/s), the
    train time of `samples` samples at that step, the final evaluation's time and score, the peaks."""
    found = _read(row / ROW_FILE) or {}
    steps = _jsonl(row / "train" / "metrics.jsonl")
    timed = [s["tokens"] / s["tokens_per_s"] for s in steps[warmup:] if s.get("tokens_per_s")]
    out = {k: found.get(k) for k in ("micro", "batch", "predicted_micro", "predicted_step_s", "predicted_peak_gb",
                                     "probe_peak_gb", "oom_in_training", "predicted_train_s")}
    if timed:
        step = statistics.median(timed)
        tokens = statistics.median(s["tokens"] for s in steps[warmup:])
        out.update(step_s=round(step, 4), train_s=round(step * samples / found["batch"], 3),
                   tokens_per_s=round(tokens / step, 1))
        # model FLOPs of the trained tokens: 6 x parameters a target token (an encoder's source tokens aside)
        out["tflops"] = round(6 * found["params"] * out["tokens_per_s"] / 1e12, 4) if found.get("params") else None
    last = steps[-1] if steps else {}
    out.update(peak_gpu_gb=last.get("peak_gpu_gb"), host_rss_gb=last.get("host_rss_gb"))
    evals = _jsonl(row / "train" / "eval.jsonl")
    if evals:
        out.update(eval_s=evals[-1].get("eval_s"), bleu=evals[-1].get("eval_bleu"), ppl=evals[-1].get("eval_ppl"))
    out["error"] = found.get("error")
    out["exit"] = found.get("exit")
    return out


def _read(p: Path) -> dict | None:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _jsonl(p: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


if __name__ == "__main__":
    from ..common.processes import stamp_start

    stamp_start()  # the row's own start (the bench's stamp is inherited): its first step's breakdown from here
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text())))

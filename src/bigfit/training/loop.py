"""The one training loop, the same for every strategy and process count."""
from __future__ import annotations

import contextlib
import gc
import resource
import time
from pathlib import Path

import torch

from ..adapters.lora import inject, trainable_parameters
from ..common import faults
from ..common.distributed import Runtime, init_runtime, shutdown
from ..common.precision import LossScaler, fp16_warning
from ..data import Batcher
from ..engine import Engine, build_optimizer
from ..job.checks import reporters
from ..job.prepare import Prepared, describe, load
from ..job.resolution import JOB_FILE, Job, write
from ..layout.mesh import release_run_groups, with_mesh
from ..loading import loads_per_rank
from ..models.source import build_model, count_parameters
from ..outputs import runinfo
from ..outputs.consolidate import consolidate
from ..outputs.ownership import claim
from ..parallel.apply import apply
from . import checkpoint, probe
from .evaluate import evaluate
from .metrics import FlushWatch, MetricsLog, StartClock, StepProgress, allocator_flushes, console, table
from .step import global_targets, lr_at, train_step
from .trackers import Trackers, predicted_peak


def train(job: Job, ready: Prepared | None = None) -> dict:
    """Run the resolved `job` on this process (one rank of it). `ready`: the job already prepared in
    this process (by its starter: a one-process job); else its data is mapped from where the starter
    left it. Returns the final metrics and output paths."""
    clock = StartClock()
    ready = ready or load(job)
    clock.mark("data")
    # FSDP2 needs a mesh even for one rank (to offload or to cast parameters); zero3-offload reduces
    # gradients that live in host RAM, which needs gloo beside NCCL
    rt = init_runtime(job.cfg.timeout_s, group_for_one=job.plan.engine == "fsdp", host_collectives=job.plan.offload_params)
    try:
        rt = with_mesh(rt, job.plan)
        clock.mark("runtime")
        with claim(ready, rt) as lock, _collector_paused():  # the output directory is this run's (a launcher may have claimed it)
            if lock is not None:  # claimed here (torchrun's rank 0): the run directory holds its job, as a starter's does
                write(job, Path(job.cfg.output_dir) / JOB_FILE)
            return _train(ready, rt, clock)
    finally:
        release_run_groups()
        shutdown(rt)


GC_EVERY = 50  # steps between collections of Python's young generations (torchtitan collects every 50)


@contextlib.contextmanager
def _collector_paused():
    """Python's automatic garbage collector off while training, as torchtitan does: a full collection
    walks every object (the dataset's token lists, the model's modules) and stalls every thread for
    it, the offload engine's host thread too. What exists before the run (the job and its dataset)
    is frozen out of the collections; the loop collects the young generations every GC_EVERY steps.
    The collection before the freeze is of the young generations too (torchtitan's): a full one walks
    every object the process holds, 0.16 s after importing torch and transformers, 0.23 s a run in a
    process that has run others (a notebook, the tests' kept ranks)."""
    gc.collect(1)
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.enable()


def _train(job: Prepared, rt: Runtime, clock: StartClock) -> dict:
    cfg, ds = job.cfg, job.dataset
    out_dir = Path(cfg.output_dir)
    ckpt_root = out_dir / "checkpoints"
    model = build_model(job.source, job.model_config, cfg.seed, on_meta=not rt.is_main or loads_per_rank(job.source))
    if job.lora:  # adapters first, on the unmodified model: every transform after sees them (adapters/lora.py)
        inject(model, job.lora)
    n_params, trained = count_parameters(model), trainable_parameters(model)
    clock.mark("model")
    applied = apply(model, job.plan, cfg, rt, job.job.data.lengths)
    clock.mark("placement")
    build_optimizer(applied, cfg)
    clock.mark("optimizer")
    scaler = LossScaler.from_config(cfg) if cfg.precision == "fp16" else None
    if cfg.probe_only:
        return _probe(job, applied, rt)
    faults.inject_oom(applied.module, cfg.micro_batch_size, training=True)  # the bench's tests; unset: nothing
    step = 0
    if job.resume_from:
        trainer = checkpoint.load(job.resume_from, applied, rt)
        step = trainer["step"]
        if scaler and trainer.get("loss_scaler"):
            scaler.load_state_dict(trainer["loss_scaler"])
        clock.mark("resume")
    if rt.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        console.print(table("bigfit train", describe(job, n_params, rt.device, applied.notes, trained)))
        if warning := fp16_warning(job.model_config.model_type, cfg.precision):
            console.print(f"[yellow]{warning}[/yellow]")
    resumed_at = step if job.resume_from else None
    metrics = MetricsLog(out_dir / "metrics.jsonl", resumed_at) if rt.is_main else None
    evals = MetricsLog(out_dir / "eval.jsonl", resumed_at) if rt.is_main else None
    batcher = Batcher(len(ds.train), cfg.batch_size, cfg.seed)
    write_assets = checkpoint.assets_writer(applied.module, job.tokenizer)
    run = runinfo.read(out_dir) if rt.is_main else {}  # written by the claim: checkpoints carry the run's identity
    boards = _boards(job, out_dir, run, rt) if rt.is_main else None  # dashboards beside metrics.jsonl (--report-to)

    def run_eval() -> dict:
        began = time.perf_counter()
        applied.flush()  # a delayed update lands before anything reads the parameters
        out = evaluate(applied, ds.eval, tokenizer=job.tokenizer, pad_id=ds.pad_id, seq2seq=job.seq2seq, rt=rt,
                       batch_size=cfg.micro_batch_size, num_beams=cfg.num_beams, max_new_tokens=cfg.max_new_tokens)
        return {**out, "eval_s": round(time.perf_counter() - began, 3)} if out else out  # bigfit bench reads it

    first_eval = run_eval() if step == 0 and cfg.eval_on_start else {}
    if first_eval:
        clock.mark("eval at start")
    if first_eval and rt.is_main:
        evals.write({"step": 0, **first_eval})
        boards.log({"step": 0, **first_eval})
        console.print(f"eval at step 0: {_eval_text(first_eval)}")
    progress = StepProgress(step, cfg.max_steps) if rt.is_main else None
    flushes = FlushWatch(lambda: allocator_flushes(rt.device)) if rt.device.type == "cuda" else None
    last_eval, last_ckpt, t_start = first_eval, None, time.perf_counter()
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        data = rt.data  # pipeline and tensor-parallel peers read the same samples
        micro = batcher.micro_batches(step, data.rank, data.world_size, cfg.micro_batch_size)
        tokens = global_targets([ds.train[i] for i in batcher.global_batch(step)], job.seq2seq)  # no collective
        record = train_step(applied, [[ds.train[i] for i in mb] for mb in micro], pad_id=ds.pad_id,
                            seq2seq=job.seq2seq, rt=rt, lr=lr_at(step, cfg), max_grad_norm=cfg.max_grad_norm,
                            scaler=scaler, total_tokens=tokens)
        step += 1
        record = {"step": step, **record, "tokens_per_s": record["tokens"] / (time.perf_counter() - t0)}
        if rt.device.type == "cuda":  # this rank's peak since the start (torchtitan logs the same)
            record["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated(rt.device) / 1e9, 2)
            if (said := flushes.update(record, step, cfg.micro_batch_size)) and rt.is_main:
                progress.print(said)
        record["host_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)  # its peak
        if clock is not None:  # the first step of this process: where the wait for it went
            clock.mark("first step")
            record["startup_s"] = clock.record()
        if step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0):
            last_eval = run_eval()
            record.update(last_eval)
        if rt.is_main:
            metrics.write(record)
            boards.log(record)
            progress.update(step, record["loss"], record["tokens_per_s"])
            if clock is not None:
                progress.print(clock.line())
            if "eval_loss" in record:
                evals.write({"step": step, **last_eval})
                progress.print(f"eval at step {step}: {_eval_text(record)}")
            if scaler and record["overflow"]:
                progress.print(_overflow_text(step, record, scaler))
        clock = None
        if step % GC_EVERY == 0:
            gc.collect(1)  # the young generations only: the model, data and engine are frozen
        faults.maybe_die("step", step, rt)
        if cfg.checkpoints and (step == cfg.max_steps or (cfg.save_every and step % cfg.save_every == 0)):
            applied.flush()
            trainer = {"step": step, "world_size": rt.world_size, "config": cfg.to_dict(), "plan": job.plan.to_dict(),
                       "loss_scaler": scaler.state_dict() if scaler else None, "run_id": run.get("run_id"),
                       "identity": run.get("identity")}
            last_ckpt = checkpoint.save(ckpt_root, step, applied, rt, trainer, write_assets,
                                        keep=cfg.keep_checkpoints)
    summary = {"steps": step, "first_eval": first_eval, "last_eval": last_eval, "checkpoint": last_ckpt,
               "metrics": out_dir / "metrics.jsonl", "evals": out_dir / "eval.jsonl", "train_time_s": time.perf_counter() - t_start}
    if rt.is_main:
        progress.close()
        metrics.close()
        boards.close()
        evals.close()
        if cfg.consolidate and last_ckpt is not None:
            # this run's own model directory (the claim made sure): replaced, files bigfit did not write kept;
            # a LoRA run's is its adapter (bigfit consolidate --merge makes the merged model)
            if job.lora:
                summary["adapter_dir"] = consolidate(last_ckpt, out_dir / "adapter", overwrite=True)
            else:
                summary["model_dir"] = consolidate(last_ckpt, out_dir / "model", overwrite=True)
        _print_summary(summary)
    return summary


def _boards(job: Prepared, out_dir: Path, run: dict, rt: Runtime) -> Trackers:
    """The dashboards of --report-to (none: an empty set), with the planner's peak for the run."""
    cfg = job.cfg
    names = reporters(cfg.report_to)
    predicted, note = predicted_peak(cfg, rt.world_size, job.job.data.lengths) if names else (None, "")
    if note:
        console.print(f"[yellow]{note}[/yellow]")
    return Trackers(names, out_dir, cfg.to_dict(), run.get("run_id") or out_dir.name, predicted)


def _probe(job: Prepared, applied: Engine, rt: Runtime) -> dict:
    """micro-batch auto's probe (training/probe.py): candidate micro-batches tried one after another on
    this model and engine, built once; the process exits after it, and the real job starts apart."""
    return probe.probe(job, applied, rt)


def _overflow_text(step: int, record: dict, scaler: LossScaler) -> str:
    text = (f"step {step}: fp16 gradients overflowed at loss scale {record['loss_scale']:g}; step skipped "
            f"({scaler.overflows} so far), scale now {scaler.scale:g}")
    if scaler.alarm:
        text += (f"\n[red]the loss scale sits at its minimum ({scaler.min_scale:g}) and steps keep overflowing: "
                 "this model overflows fp16 itself (common for models pretrained in bf16); use --precision bf16 "
                 "or fp32[/red]")
    return text


def _eval_text(r: dict) -> str:
    parts = [f"loss {r['eval_loss']:.4f}"]
    if "eval_bleu" in r:
        parts += [f"BLEU {r['eval_bleu']:.1f}", f"exact match {r['eval_exact_match']:.1%}",
                  f"e.g. {r['eval_example']['output']!r} (reference {r['eval_example']['reference']!r})"]
    else:
        parts.append(f"perplexity {r['eval_ppl']:.2f}")
    return ", ".join(parts)


def _print_summary(s: dict) -> None:
    rows = [("steps", f"{s['steps']} in {s['train_time_s']:.1f}s"), ("metrics", s["metrics"]),
            ("evaluations", s["evals"])]
    if s["first_eval"] and "eval_bleu" in s["first_eval"] and s["last_eval"]:
        rows.append(("BLEU", f"{s['first_eval']['eval_bleu']:.1f} -> {s['last_eval']['eval_bleu']:.1f}"))
    if s["checkpoint"]:
        rows.append(("last checkpoint", s["checkpoint"]))
    if s.get("model_dir"):
        rows.append(("model (Hugging Face)", s["model_dir"]))
    if s.get("adapter_dir"):
        rows.append(("LoRA adapter (peft)", s["adapter_dir"]))
    console.print(table("done", rows))

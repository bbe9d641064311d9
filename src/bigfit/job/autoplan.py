"""What `bigfit train` asks the planner about its own job on this machine: the machine as the job's
processes see it (_this_machine), `--strategy auto`'s pick over the named strategies and the composed
plans, `--batch-size auto` / `--micro-batch-size auto`'s largest micro-batch predicted to fit, and the
figures a launched run reads from its plan (peak memory for the dashboards, the offload engine's state
format, the NVMe tier's share in RAM). `bigfit plan` itself is commands/plan.py."""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from ..adapters.lora import LoraSettings
from ..errors import BigfitError
from ..layout.plan import ALIASES, DIMS, plan_for
from ..machine.calibration import cpu_rates, disk
from ..machine.hardware import GLOO_LOCAL_GBPS, Hardware, cpu_host_figures, detect, host_ram
from ..models.source import load_config, locate
from ..planning.devicecost import cpu_device_rates
from ..planning.keeping import OFFLOAD_MARGIN, fixed, keeping_text, settings_of
from ..planning.workload import planned_lengths
from ..planning.rows import gpu_cap, with_slack
from ..planning.search import SPLIT_MARGIN, WHOLE, Workload, plan_for_config
from ..planning.sizes import MAX_MICRO, Prediction, divisors, largest_true
from ..planning.device_map_row import NAME as DEVICE_MAP
from ..settings.config import PIPELINE_STRATEGIES, SPLIT_STRATEGIES, STRATEGIES, auto_precision


def _this_machine(world: int, strategy: str | None = None, nvme_dir: str | None = None) -> Hardware:
    """The GPUs a job of `world` local processes uses, or on a CPU-only machine its RAM split over them;
    device_map's one process drives every GPU. `nvme_dir`: the NVMe tier's directory, whose disk (90%
    of its free space, its measured bandwidth: calibration.disk) joins the description. The CPU's
    processes compute at their share of its measured rates (calibration.cpu_rates), not a GPU's."""
    if torch.cuda.is_available():
        hw = detect()
    else:
        r = cpu_rates()
        hw = Hardware(gpu_bytes=(host_ram() // world,) * world, device="cpu", **cpu_host_figures(),
                      intra_gbps=GLOO_LOCAL_GBPS, **cpu_device_rates(r["tflops"], r["mem_gbps"], world),
                      notes=(f"CPU: {r['tflops']:.2f} TFLOP/s fp32 matmul, {r['mem_gbps']:.0f} GB/s memory on "
                             f"{r['cores']} cores (measured {r['measured']}), shared by {world} process(es)",))
    if nvme_dir is not None:
        free, gbps = disk(nvme_dir)
        hw = replace(hw, nvme=int(free * 0.9), nvme_gbps=gbps,
                     notes=(*hw.notes, f"NVMe tier at {nvme_dir}: {free / 1e9:.0f} GB free, {gbps:.2f} GB/s measured"))
    return hw if strategy == DEVICE_MAP else replace(hw, gpu_bytes=hw.gpu_bytes[:world])


def _with_map_budgets(hw: Hardware, cfg) -> Hardware:
    """device_map rated on the budgets `--device-map {"auto": {...}}` names, as its balancer will place it."""
    if cfg.strategy not in SPLIT_STRATEGIES:
        return hw
    from ..planning.automap import parse_budgets
    from ..device_map.strategy import read_spec  # a map file's reading and its one-line errors

    kind, spec = read_spec(cfg)
    return replace(hw, map_budgets=tuple(parse_budgets(spec))) if kind == "auto" and spec else hw


def _job(cfg, config, batch: int, micro: int | None, lengths: tuple[int, int] | None = None) -> Workload:
    """The planner's Job of TrainConfig `cfg` at these sizes: made here alone, for `bigfit plan` (planner_job)
    and for every decision `bigfit train` asks the planner. `lengths`: the data's longest sample
    (planning/workload.py planned_lengths)."""
    source, target = planned_lengths(cfg, lengths)
    how = activations_of(cfg)
    return Workload(batch_size=batch, seq_len=source, target_len=target if config.is_encoder_decoder else 0, micro_batch=micro,
               precision=cfg.precision or auto_precision(), checkpointing=how in ("checkpoint", "offload"),
               checkpoint_blocks=cfg.checkpoint_blocks if how in ("checkpoint", "offload") else None,
               offload_activations=how == "offload", choose_activations=how == "auto", loss_chunk=cfg.loss_chunk,
               context_parallel=True,  # the composed plans rate cp degrees for decoder-only models (layouts.py)
               delayed_update=cfg.delayed_update, offload_grads=cfg.offload_grads, nvme_host_gb=cfg.nvme_host_gb,
               clipping=cfg.max_grad_norm > 0, chunks=cfg.chunks,
               pipeline_schedule=cfg.pipeline_schedule, stages_per_rank=cfg.stages_per_rank,
               sequence_parallel=cfg.sequence_parallel, compile=cfg.compile, lora=LoraSettings.from_config(cfg),
               load_in_4bit=cfg.load_in_4bit,
               # auto: the most exact format that fits, as --strategy auto chooses it for the offload rows; a
               # named offload strategy runs fp32 (resolution.resolve), and the other strategies keep no such states
               optimizer_states=planned_states(cfg.optimizer_states)
               if cfg.optimizer_states != "auto" or not cfg.strategy.startswith("zero2-offload") else "fp32")


def activations_of(cfg) -> str:
    """How cfg keeps activations for the planner: --activations, --activation-checkpointing standing for
    checkpoint where --activations is auto or keep (resolution.activation_plan's rule); "auto" is
    for the planner to choose, row by row (planning/keeping.py)."""
    if cfg.activation_checkpointing and cfg.activations in ("auto", "keep"):
        return "checkpoint"
    return cfg.activations


def planner_job(cfg, config, world: int, lengths: tuple[int, int] | None = None) -> Workload:
    """The job `bigfit plan` rates for TrainConfig `cfg` on `world` processes, as `--strategy auto` rates
    it: the batch sizes given, one sample a process where they are auto."""
    micro = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else None
    return _job(cfg, config, cfg.batch_size if isinstance(cfg.batch_size, int) else world, micro, lengths)


def default_processes(cfg) -> int:
    """The processes a job runs on this machine without --nproc: one for single and device_map (one
    process drives every GPU), else one per GPU, or 2 on a machine without GPUs: `bigfit train`'s
    processes and `bigfit plan`'s alike."""
    if cfg.strategy in ("single", *SPLIT_STRATEGIES):
        return 1
    return torch.cuda.device_count() or 2


def planned_states(value: str) -> str | None:
    """--optimizer-states for the planner: "auto" is None, the most exact format that fits."""
    return None if value == "auto" else value


def auto_strategy(cfg, world: int, one_process: bool = True, lengths: tuple[int, int] | None = None) -> tuple[str, str]:
    """`--strategy auto`: plan for this machine and return the recommendation and why. device_map (one
    process driving every GPU) is a candidate unless the job's processes are fixed (`one_process` False:
    --nproc, torchrun); pipeline (one process per GPU, every stage reading the whole batch) when there
    are 2 processes or more and the batch sizes are numbers (`auto` sizes probe data-parallel shares).
    Picked, they run with their defaults (--device-map auto; pipeline: config.pipeline_defaults), as
    planned. `lengths`, here and below: the data's longest sample (job/prepare.py data_lengths), which
    the planner rates in place of the length limits."""
    p = _auto(cfg, world, _named(cfg, world, one_process), None, lengths)
    if p.recommended is None:
        raise BigfitError(f"--strategy auto: {p.reason}")
    return _sized_pick(cfg, world, p, lengths)


def auto_plan(cfg, world: int, one_process: bool = True, lengths: tuple[int, int] | None = None) -> tuple[str, dict[str, int], str]:
    """`--strategy auto` over the named strategies (as auto_strategy) and the composed plans:
    (strategy alias, {"tp", "pp", "dp_shard", "dp_replicate"} for plan_for, why). A composed plan is
    taken only where it beats every named one that fits (layouts.choose); the degrees cfg gives
    (--tp, --pp, --dp-shard, --dp-replicate) restrict both. device_map's degrees are its one process's."""
    fixed = {d: getattr(cfg, d) for d in DIMS if getattr(cfg, d, None)}
    named = tuple(s for s in _named(cfg, world, one_process) if _agrees(_degrees(s, world), fixed))
    p = _auto(cfg, world, named, fixed, lengths)
    if p.layout_pick is not None:
        return p.layout_pick.strategy, p.layout_pick.degrees, p.layout_reason
    if p.recommended is None:
        raise BigfitError(f"--strategy auto: {p.reason}; composed plans: {p.layout_reason}")
    name, reason = _sized_pick(cfg, world, p, lengths)
    return name, _degrees(name, world), f"{reason}; composed plans: {p.layout_reason}"


def auto_named(cfg, world: int, strategies: tuple[str, ...], lengths: tuple[int, int] | None = None) -> tuple[str | None, str]:
    """`--strategy auto`'s pick among the named `strategies` and why (None: none fits): `bigfit
    bench`'s pick beside the fastest it measured."""
    p = _auto(cfg, world, strategies, None, lengths)
    return _sized_pick(cfg, world, p, lengths) if p.recommended else (None, p.reason)


def _sized_pick(cfg, world: int, p, lengths: tuple[int, int] | None = None) -> tuple[str, str]:
    """The plan's pick with the batch sizes given; with `--batch-size auto`, where each strategy will
    run at the largest micro-batch it holds, the one that trains a sample in the least time there
    (strategies that hold more samples, zero2 and zero3 beside single, gain by it; `bigfit bench` on
    an H200, T5-large: single fastest at one sample, zero2 and zero3 at their largest)."""
    if cfg.batch_size != "auto" or isinstance(cfg.micro_batch_size, int):  # the sizes are the user's
        return p.recommended, p.reason
    planned = _auto_job(cfg, world, lengths)  # the model, machine and job once: each strategy searches its sizes on them
    rated = sorted(r for r in (_at_largest(cfg, world, planned, c.estimate.name) for c in p.candidates
                               if c.fits and not c.why_not) if r)
    if not rated:
        return p.recommended, p.reason
    *_, name, micro, per_s = rated[0]
    others = ", ".join(f"{n} {s:.1f} at {m}" for *_, n, m, s in rated[1:4])
    return name, (f"{name} trains the most samples a second at the largest micro-batch each strategy is predicted "
                  f"to hold (--batch-size auto): {per_s:.1f} at micro-batch {micro}" + (f"; {others}" if others else ""))


def _at_largest(cfg, world: int, planned, name: str) -> tuple | None:
    """`name` under --batch-size auto at the largest micro-batch predicted to fit, as search._rank
    orders rows (the seconds a sample with device_map's and pipeline's margin for what is unmeasured;
    on a tie the one that communicates less, then the smaller), then (name, micro-batch, samples a
    second); None where not even the smallest fits."""
    procs = 1 if name in SPLIT_STRATEGIES else world
    rated = _largest_micro(planned, name, _micro_sizes(cfg, procs),
                           lambda m: {"batch_size": m * procs, "micro_batch": m})
    if rated is None:
        return None
    micro, c = rated
    e = c.estimate
    per_sample = e.step_time_s / (micro * procs)
    return (round(per_sample * (SPLIT_MARGIN if name in WHOLE else 1.0), 9), e.costs.get("communication", 0.0),
            e.per_gpu["total"], name, micro, 1 / per_sample)


def _largest_micro(planned, name: str, sizes: list[int], job_at) -> tuple[int, object] | None:
    """The largest of `sizes` at which `name` fits with CACHE_SLACK of every GPU's budget left, with its
    row: `planned` is (config, machine, job), the job changed by job_at(m). device_map's map must also
    compute no more blocks on the host than at the smallest size: its balancer makes room for a larger
    micro-batch by moving blocks to the host, which computes them tens of times slower (T5-large on an
    H100: 4.3 ms a sample at 128 with every block on the GPU, 47 ms at 160 with 7 on the host), so the
    largest that fits would be the slowest. The bytes grow with the micro-batch, so sizes.largest_true
    plans about 2 log2(answer) sizes, and the trace of each is drawn from two (profile.py)."""
    config, full, job = planned
    # each GPU less its share for the allocator's cache (mixed sizes: each its own; a device map's or a
    # pipeline's parts are checked device by device)
    hw = with_slack(full)
    if not job.choose_activations:
        return _largest_kept(config, hw, job, name, sizes, job_at)
    # --activations auto: each way's largest micro-batch (checkpointing and offload hold more samples),
    # rated there with the way the row takes at that size (the fewest checkpointed blocks that fit: on
    # the whole GPUs, where the choice leaves the allocator's share itself, rows.roomy), and the one that
    # trains a sample fastest (offload's copies unmeasured: OFFLOAD_MARGIN on a near tie)
    ways = ("keep", "checkpoint") + (("offload",) if hw.device == "cuda" and name not in WHOLE else ())
    found = []
    for i, how in enumerate(ways):
        kept = _largest_kept(config, hw, fixed(job, how), name, sizes, job_at)
        if kept is not None:
            # device maps and pipelines: the way's own row (their choice weighs host blocks by their time)
            m, c = kept if name in WHOLE else _largest_kept(config, full, job, name, [kept[0]], job_at) or kept
            per_sample = c.estimate.step_time_s / job_at(m)["batch_size"] * (OFFLOAD_MARGIN if how == "offload" else 1)
            found.append((round(per_sample, 12), i, m, c))
    return min(found, key=lambda f: f[:2])[2:] if found else None


def _largest_kept(config, hw, job, name: str, sizes: list[int], job_at) -> tuple[int, object] | None:
    """_largest_micro for one way of keeping activations (or --activations auto's choice at each size)."""
    rows = {}

    def row(m: int):
        if m not in rows:
            p = plan_for_config(config, hw, replace(job, **job_at(m)), strategies=(name,))
            rows[m] = p.candidates[0], _host_blocks(p.device_map)
        return rows[m]

    def holds(m: int) -> bool:
        c, host = row(m)
        return c.fits and host <= row(sizes[0])[1]

    best = largest_true(holds, sizes)
    return None if best is None else (best, row(best)[0])


def _host_blocks(section: dict | None) -> int:
    """The blocks a device map computes on the host (0 for the other strategies' plans)."""
    return sum(d.startswith("cpu") for d in (section or {}).get("assignment") or ())


def _micro_sizes(cfg, procs: int) -> list[int]:
    """The micro-batches a process may run: any up to MAX_MICRO (and to its share of
    --max-train-samples) for --batch-size auto, else those that split its share of the batch into
    whole accumulation steps; at least --chunks (a device_map's GPipe chunks split each micro-batch)."""
    low = cfg.chunks or 1
    top = MAX_MICRO if cfg.max_train_samples is None else max(low, min(MAX_MICRO, cfg.max_train_samples // procs))
    return list(range(low, top + 1)) if cfg.batch_size == "auto" else divisors(cfg.batch_size // procs, low)


def _named(cfg, world: int, one_process: bool) -> tuple[str, ...]:
    """The named candidates of `auto`: device_map (one process driving every GPU) unless the job's
    processes are fixed; pipeline with 2 processes or more and numbers for the batch sizes."""
    sized = "auto" not in (cfg.batch_size, cfg.micro_batch_size)
    return (STRATEGIES + (SPLIT_STRATEGIES if one_process else ())
            + (PIPELINE_STRATEGIES if world > 1 and sized else ()))


def _auto(cfg, world: int, strategies: tuple[str, ...], layouts: dict | None, lengths: tuple[int, int] | None = None):
    config, hw, job = _auto_job(cfg, world, lengths)
    return plan_for_config(config, hw, job, strategies, layouts)


def _auto_job(cfg, world: int, lengths: tuple[int, int] | None = None):
    """(model config, machine, job) that `--strategy auto` plans: the job at cfg's sizes (one sample
    a process where they are auto), the NVMe tier's disk in the machine."""
    config = load_config(locate(cfg.model))
    nvme_dir = cfg.nvme_dir or os.path.join(cfg.output_dir, "nvme")  # where zero2-offload-nvme would write
    job = planner_job(cfg, config, world, lengths)  # nvme_host_gb None: rated with the states RAM can hold kept there
    return config, _this_machine(world, nvme_dir=nvme_dir), job


def plan_here(cfg, world: int, strategies: tuple[str, ...], lengths: tuple[int, int] | None = None):
    """The plan of cfg's job on this machine over `strategies` (named ones), as `--strategy auto` makes
    it: `bigfit bench`'s candidates, predictions and the pick it compares with the fastest measured."""
    return _auto(cfg, world, strategies, None, lengths)


def predicted_row(cfg, world: int, lengths: tuple[int, int] | None = None):
    """The planner's row (a Candidate; composed: a LayoutCandidate) for the run's own strategy and degrees,
    rated on this machine (`lengths`: the data's longest sample); None where it rates no such row."""
    fixed = {d: getattr(cfg, d) for d in DIMS if getattr(cfg, d, None)}
    p = _auto(cfg, world, () if fixed else (cfg.strategy,), fixed or None, lengths)
    rows = [c for c in p.candidates if c.estimate.name == cfg.strategy] if not fixed else [
        c for c in p.layouts or () if c.strategy == cfg.strategy and _agrees(c.degrees, fixed)]
    return rows[0] if rows else None


def predicted_peak_gb(cfg, world: int, lengths: tuple[int, int] | None = None) -> float | None:
    """The peak GB of the busiest device the planner predicts for the run's own strategy and degrees
    (the dashboards draw it beside the measured peak); None where it rates no such row."""
    row = predicted_row(cfg, world, lengths)
    return round(row.estimate.per_gpu["total"] / 1e9, 4) if row else None  # a tiny model's megabytes too


def prediction(cfg, world: int, lengths: tuple[int, int] | None = None) -> str | None:
    """The planner's row for the strategy and degrees resolved TrainConfig `cfg` runs on `world` processes
    of this machine (`lengths`: the data's longest sample, as `bigfit plan --data` reads it), as one line
    (`row_text`): `bigfit plan` with the same settings rates the same row, and `row_text` of its --json
    row says the same; None where the planner rates no such row."""
    row = predicted_row(cfg, world, lengths)
    return row_text(row.to_json()) if row else None


def row_text(row: dict) -> str:
    """A plan's row (`bigfit plan --json`'s, a Candidate's to_json) in words: its peak GB on the busiest
    device, seconds a step and tokens a second, and why it does not fit where it does not."""
    return (f"{row['name']}: {row['per_gpu_bytes']['total'] / 1e9:.3g} GB peak per device, {row['step_time_s']:.3g} s "
            f"a step ({row['bottleneck']}), {row['tokens_per_s']:,.0f} tokens/s"
            + ("" if row["fits"] else f"; does not fit: {row['why_not']}"))


def optimizer_states(cfg, world: int, strategy: str, lengths: tuple[int, int] | None = None) -> str:
    """The moments' format `--strategy auto`'s row of `strategy` (an offload engine's) was rated with:
    the most exact that fits, for the run it launches."""
    return _auto(cfg, world, (strategy,), None, lengths).candidates[0].estimate.states


def nvme_host_gb(cfg, world: int, lengths: tuple[int, int] | None = None) -> float:
    """The GB per node of optimizer states `--strategy auto`'s zero2-offload-nvme row kept in RAM
    (estimate.nvme_fill), for the run it launches: not rounded, which would put a small model's states
    (under 50 MB) all on the disk."""
    p = _auto(cfg, world, ("zero2-offload-nvme",), None, lengths)
    return max(0.0, p.candidates[0].estimate.per_host["optimizer"]) / 1e9


def _agrees(degrees: dict[str, int], fixed: dict[str, int]) -> bool:
    return all(degrees[d] == v for d, v in fixed.items())


def _degrees(strategy: str, world: int) -> dict[str, int]:
    """The degrees a named strategy runs with on `world` processes (device_map: one process)."""
    p = plan_for(strategy, 1 if ALIASES[strategy].one_process else world)
    return {d: getattr(p, d) for d in DIMS}


def auto_micro_batch(cfg, world: int, lengths: tuple[int, int] | None = None) -> Prediction:
    """`--micro-batch-size auto` (and `--batch-size auto`): the largest micro-batch predicted to fit
    for cfg.strategy, among any size up to MAX_MICRO for --batch-size auto (no accumulation: the
    global batch is micro x processes) or the divisors of each process's share of a fixed batch
    (accumulation steps are whole), at least --chunks."""
    sizes, hw, rated = _micro_rated(cfg, world, lengths)
    if rated is None:
        raise BigfitError(f"--micro-batch-size auto: not even micro-batch {sizes[0] if sizes else cfg.chunks or 1} is "
                          f"predicted to fit with {cfg.strategy}; see `bigfit plan` for what would")
    best, c = rated
    return Prediction(best, c.estimate.per_gpu["total"], gpu_cap(hw), sizes, c.estimate.step_time_s)


def _micro_rated(cfg, world: int, lengths: tuple[int, int] | None, choose: bool = False):
    """(the sizes micro-batch auto may take, the machine, (the largest predicted to fit, its row) or None).
    Activations kept as cfg's run keeps them, which --activations auto still undecided keeps (resolution:
    the probe runs the job as resolved); `choose`: --activations auto's own choice (planned_activations)."""
    sizes = _micro_sizes(cfg, world)
    auto = cfg.batch_size == "auto"
    config = load_config(locate(cfg.model))
    # the NVMe tier's disk, as `--strategy auto` rated it: without it no size of zero2-offload-nvme fits
    nvme_dir = (cfg.nvme_dir or os.path.join(cfg.output_dir, "nvme")) if cfg.strategy == "zero2-offload-nvme" else None
    hw = _with_map_budgets(_this_machine(world, cfg.strategy, nvme_dir=nvme_dir), cfg)
    job = _job(cfg, config, 1, None, lengths)
    job = job if choose or not job.choose_activations else fixed(job, "keep")
    rated = _largest_micro((config, hw, job), cfg.strategy, sizes,
                           lambda m: {"batch_size": m * world if auto else cfg.batch_size, "micro_batch": m})
    return sizes, hw, rated


def planned_activations(cfg, world: int, lengths: tuple[int, int] | None = None) -> tuple[dict, str] | None:
    """`--activations auto` for the run's own strategy and degrees on this machine: (the settings that
    run the way its row keeps activations, {"activations", "checkpoint_blocks"}; why), or None where the
    planner rates no such row. With micro-batch auto, the way that trains a sample fastest at the largest
    micro-batch it holds (_largest_micro), which the probe then confirms; else the row's at the sizes
    given. The row's way is the most frugal one where nothing fits (its reason says by how much)."""
    if "auto" in (cfg.batch_size, cfg.micro_batch_size):
        _, _, rated = _micro_rated(cfg, world, lengths, choose=True)
        row, micro = (rated[1], rated[0]) if rated else (None, None)
    else:
        row, micro = predicted_row(cfg, world, lengths), cfg.micro_batch_size
    if row is None:
        return None
    e, at = row.estimate, f" at micro-batch {micro}" if micro else ""
    said = keeping_text(e) or "keep"
    why = (f"{e.name}{at}: {e.per_gpu['total'] / 1e9:.3g} GB per device, {e.step_time_s:.3g} s a step"
           + ("" if row.fits else f"; the most frugal way, and still it {row.why_not}"))
    return settings_of(e), f"{said} ({why})"

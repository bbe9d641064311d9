"""Composed plans: every factorisation of the job's processes into (pp, dp_replicate, dp_shard, cp, tp)
that ParallelPlan accepts for a data-parallel kind (ddp, zero1, zero2, zero3, and the offload ones
where plan_for allows), rated by composed.py beside the named strategies, with why the others were
rejected, grouped. tp divides the model's heads, KV heads and FFN width and stays within a node; pp is
at most the blocks; the global batch divides over the data-parallel ranks; cp (where the job rates
context parallelism, or --cp asks) splits a decoder-only model's sequence into two slices a rank.
Layouts a named row already rates (dp_shard or dp_replicate over every GPU, a pipeline over every GPU)
are not repeated.

A composed plan is recommended only when it beats every named strategy that fits by LAYOUT_MARGIN:
its tensor-parallel and pipeline x data-parallel times rest on assumptions no GPU run has checked."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import BigfitError
from ..layout.cut import PipelineLayout, balance, check_depth
from ..layout.plan import DIMS, ParallelPlan, plan_for
from ..settings.config import pipeline_defaults
from . import composed, keeping
from .rows import Candidate, fit_problem, gb, roomy
from .tp_trace import valid_tp

KINDS = ("ddp", "zero1", "zero2", "zero3", "zero3-offload", "zero2-offload", "zero2-offload-nvme")
LAYOUT_MARGIN = 1.10  # as search.SPLIT_MARGIN: a near tie goes to a named row, whose times are measured
SHOWN = 5  # composed plans `bigfit plan` lists, fastest first


@dataclass
class LayoutCandidate(Candidate):
    strategy: str = "zero3"  # the alias that, with `degrees`, gives plan_for this plan
    plan: ParallelPlan | None = None

    @property
    def degrees(self) -> dict[str, int]:
        return {d: getattr(self.plan, d) for d in DIMS}

    def to_json(self) -> dict:
        p = self.plan
        pipe = {"schedule": p.schedule, "stages_per_rank": p.stages_per_rank, "chunks": p.chunks} if p.pp > 1 else None
        return {**super().to_json(), "strategy": self.strategy, "degrees": self.degrees, "zero": p.zero,
                "pipeline": pipe}


@dataclass(frozen=True)
class Rejected:
    name: str  # the degrees, as a row would be named
    group: str  # the reason, in words shared by every layout it rejects
    detail: str  # the line that says it for this one


def factorisations(world: int, context: bool = False) -> list[tuple[int, int, int, int, int]]:
    """Every (pp, dp_replicate, dp_shard, cp, tp) whose product is `world`; cp 1 unless `context`."""
    divs = [d for d in range(1, world + 1) if world % d == 0]
    return [(pp, r, s, cp, world // (pp * r * s * cp)) for pp in divs for r in divs if (world // pp) % r == 0
            for s in divs if (world // (pp * r)) % s == 0
            for cp in (divs if context else (1,)) if (world // (pp * r * s)) % cp == 0]


def dims_name(degrees: dict[str, int]) -> str:
    return " x ".join(f"{d}{v}" for d, v in degrees.items() if v > 1) or "one process"


def layout_name(p: ParallelPlan, kind: str) -> str:
    """`pp2 x dp_shard2 x tp2 (zero3)`; no kind where nothing is data-parallel (`pp2 x tp4`); `sp`
    with sequence parallelism (`dp_shard2 x tp2 (zero3, sp)`, `tp4 (sp)`)."""
    dims = dims_name({d: getattr(p, d) for d in DIMS})
    what = [] if p.dp == 1 and p.zero == 0 and not p.offload_params else [kind]
    what += ["sp"] if p.sequence_parallel else []
    return f"{dims} ({', '.join(what)})" if what else dims


def layout_rows(prof, hw, job, fixed: dict[str, int]) -> tuple[list[LayoutCandidate], list[Rejected]]:
    """Every composed layout with the `fixed` degrees, rated (fitting ones first, fastest first),
    and the rejected ones. `prof` is the data-parallel trace (at job.micro(world))."""
    world, rows, rejected = hw.world_size, [], []
    if hw.device == "cpu":
        return [], [Rejected("every layout", "a CPU-only machine", "composed layouts are rated for GPUs only")]
    # context parallelism where the job asks for it: the planner's own jobs (job/autoplan.py), or --cp
    context = job.context_parallel or fixed.get("cp", 1) > 1
    for pp, dpr, dps, cp, tp in factorisations(world, context):
        degrees = dict(zip(DIMS, (pp, dpr, dps, cp, tp)))
        if any(degrees[d] != v for d, v in fixed.items()):
            continue
        micro = job.micro_batch or job.batch_size // (dpr * dps)
        try:
            _check_model(degrees, prof, hw, job)
            pipe = _pipe(pp, prof, job, micro) if pp > 1 else None
        except _Reject as e:
            rejected.append(Rejected(dims_name(degrees), e.group, e.detail))
            continue
        plans, refusals = _plans(world, degrees, pipe, job.sequence_parallel and not prof.sp_error)
        if len(refusals) == len(KINDS):
            rejected.append(Rejected(dims_name(degrees), "bigfit cannot run these degrees with any data-parallel kind",
                                     refusals.get("zero3") or next(iter(refusals.values()))))
        rows += [rate_layout(p, kind, prof, hw, job, micro, pipe) for kind, p in plans]
    return sorted(rows, key=lambda c: (not c.fits, *order(c))), rejected


def rate_layout(p: ParallelPlan, kind: str, prof, hw, job, micro: int, pipe=None) -> LayoutCandidate:
    """One composed plan's row, its activations kept as --activations auto takes for it (keeping.choose_keeping;
    offload is not rated over pipeline stages)."""
    tokens = job.batch_size * (job.seq_len + job.target_len)
    e = keeping.choose_keeping(lambda j: composed.estimate(layout_name(p, kind), p, prof, hw, j, micro, pipe),
                                lambda e: roomy(e, hw), job, prof, offload=pipe is None)
    why = fit_problem(e, hw)
    return LayoutCandidate(e, why is None, why, tokens / e.step_time_s, strategy=kind, plan=p)


def order(c: Candidate) -> tuple[float, float, int]:
    """Fastest first; then the one that communicates less (as search._rank); then the smaller."""
    e = c.estimate
    return round(e.step_time_s, 6), e.costs.get("communication", 0.0), e.per_gpu["total"]


class _Reject(Exception):
    def __init__(self, group: str, detail: str):
        super().__init__(detail)
        self.group, self.detail = group, detail


def _check_model(degrees: dict, prof, hw, job) -> None:
    """What the model, the machine and the batch allow, before any kind is tried."""
    pp, tp, dp, g = degrees["pp"], degrees["tp"], degrees["dp_replicate"] * degrees["dp_shard"], hw.gpus_per_node
    if tp > 1 and prof.tp_error:
        raise _Reject("no tensor-parallel plan for this model", prof.tp_error)
    bad = [f"{n} {what}" for what, n in prof.tp_counts.items() if n % tp]
    if bad:
        counts = ", ".join(f"{what} ({n})" for what, n in prof.tp_counts.items())
        valid = ", ".join(map(str, valid_tp(prof.tp_counts)))
        raise _Reject(f"tp must divide the model's {counts} (valid: {valid})",
                      f"tp {tp} does not divide the {', '.join(bad)}")
    if g % tp:
        raise _Reject(f"tp leaves a node (tensor parallelism stays within one node's {g} GPUs)",
                      f"tp {tp} does not divide the node's {g} GPUs")
    if pp > prof.n_blocks:
        raise _Reject(f"more pipeline stages than the model's {prof.n_blocks} blocks",
                      f"{pp} stages for {prof.n_blocks} blocks")
    if pp > 1 and prof.pipeline_error:
        raise _Reject("the pipeline cannot cut this model", prof.pipeline_error)
    _check_context(degrees["cp"], prof, job)
    if job.batch_size % dp or (job.micro_batch and (job.batch_size // dp) % job.micro_batch):
        micro = f" in micro-batches of {job.micro_batch}" if job.micro_batch else ""
        raise _Reject(f"the batch of {job.batch_size} does not divide over the data-parallel ranks{micro}",
                      f"{dp} data-parallel ranks")


def _check_context(cp: int, prof, job) -> None:
    """Context parallelism splits a decoder-only model's sequences, into two slices a rank."""
    if cp == 1:
        return
    if job.target_len or len(prof.stacks) > 1:
        raise _Reject("context parallelism splits decoder-only models' sequences",
                      f"cp {cp} for a model of {len(prof.stacks)} stacks")
    if job.seq_len % (2 * cp):
        raise _Reject("the sequence does not split into two slices for each context-parallel rank",
                      f"{job.seq_len} tokens over 2 x cp {cp}")


def _pipe(pp: int, prof, job, micro: int) -> composed.Pipe:
    """The layout and cut training would make for pp positions, each reading one dp rank's micro-batch."""
    schedule, per, chunks = pipeline_defaults(job.pipeline_schedule, job.stages_per_rank, job.chunks, pp, micro)
    try:
        layout = PipelineLayout(world=pp, stages_per_rank=per, schedule=schedule, chunks=chunks)
        check_depth(prof.n_blocks, layout, " + ".join(f"{n} in {path}" for path, n in prof.stacks))
        if micro % chunks:
            raise BigfitError(f"--chunks {chunks} must divide the micro-batch of {micro} samples")
    except BigfitError as e:
        raise _Reject("the pipeline's layout cannot run", str(e)) from None
    return composed.Pipe(layout, balance(prof.block_params, layout.stages))


def _plans(world: int, degrees: dict, pipe,
           sequence: bool = False) -> tuple[list[tuple[str, ParallelPlan]], dict[str, str]]:
    """(kind, plan) of each data-parallel kind plan_for accepts with these degrees, one per distinct
    plan; and each refusal by kind (every kind refused: bigfit cannot run the degrees). Layouts a named
    row rates are left out; so is the offload engine without a pipeline (the zero2-offload row rates
    it over dp_shard alone), and its NVMe tier over stages (not rated). `sequence`: plans with tp and
    no pipeline split the sequence."""
    out, seen, refusals = [], set(), {}
    for kind in KINDS:
        try:
            p = plan_for(kind, world, **degrees)
        except BigfitError as e:
            refusals[kind] = str(e)
            continue
        key = (p.zero, p.offload, p.offload_params)
        if _named(p, world) or (p.engine == "offload" and (p.pp == 1 or p.offload == "nvme")) or key in seen:
            continue
        seen.add(key)
        if pipe:
            p = replace(p, schedule=pipe.layout.schedule, stages_per_rank=pipe.layout.stages_per_rank,
                        chunks=pipe.layout.chunks)
        elif sequence and p.tp > 1 and p.cp == 1:  # context parallelism splits the sequence already
            p = replace(p, sequence_parallel=True)
        out.append((kind, p))
    return out, refusals


def _named(p: ParallelPlan, world: int) -> bool:
    """A layout one of the named rows rates: ddp or zero* over every GPU, or a pipeline over them."""
    flat = p.tp == 1 and p.pp == 1
    return p.pp == world or (flat and (p.dp_shard == world or (p.dp_replicate == world and p.zero == 0)))


def choose(named: list[Candidate], rows: list[LayoutCandidate]) -> tuple[LayoutCandidate | None, str]:
    """The composed plan to recommend over every named row, or None; and why."""
    fit = [r for r in rows if not r.why_not]
    if not fit:
        return None, "no composed plan fits" if rows else "no composed plan to rate"
    best, e = fit[0], fit[0].estimate
    rivals = sorted((c.estimate for c in named if not c.why_not), key=lambda o: o.step_time_s)
    text = f"{e.step_time_s:.3f} s/step, {gb(e.per_gpu['total'])} per GPU, bound by {e.bottleneck}"
    if not rivals:
        return best, f"{e.name} fits where no named strategy does: {text}"
    if e.step_time_s * LAYOUT_MARGIN < rivals[0].step_time_s:
        return best, (f"{e.name} beats every named strategy: {text}, against {rivals[0].step_time_s:.3f} s for "
                      f"{rivals[0].name}, the fastest named one that fits")
    return None, (f"the fastest composed plan that fits, {e.name}, takes {text}; a composed plan must beat the "
                  f"fastest named one ({rivals[0].name}, {rivals[0].step_time_s:.3f} s) by "
                  f"{LAYOUT_MARGIN - 1:.0%}, since its times are not measured on GPUs yet")


def check_degrees(fixed: dict[str, int], hw, counts: dict[str, int], tp_error: str | None) -> None:
    """`bigfit plan --tp/--pp/--dp-shard/--dp-replicate/--cp`: BigfitError naming a value that cannot be a
    degree of this machine (and, for tp, of this model), before anything is traced."""
    world, g = hw.world_size, hw.gpus_per_node
    where = f"the {world} GPUs" + (f" ({hw.nodes} nodes of {g})" if hw.nodes > 1 else "")
    divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
    for d, v in fixed.items():
        if world % v:
            raise BigfitError(f"--{flag(d)} {v} does not divide {where}; choose one of {divisors}")
    product = math.prod(fixed.values())
    if world % product:
        given = " x ".join(f"--{flag(d)} {v}" for d, v in fixed.items())
        raise BigfitError(f"{given} = {product} does not divide {where}; choose degrees whose product divides {world}")
    tp = fixed.get("tp", 1)
    if tp > 1 and tp_error:
        raise BigfitError(f"--tp {tp}: {tp_error}")
    bad = [f"{n} {what}" for what, n in counts.items() if n % tp]
    if bad:
        raise BigfitError(f"--tp {tp} does not divide the {', '.join(bad)} of this model; valid degrees: "
                          + ", ".join(map(str, valid_tp(counts))))
    if g % tp:
        raise BigfitError(f"--tp {tp} does not divide a node's {g} GPUs: tensor parallelism stays within one node")


def flag(dim: str) -> str:
    return dim.replace("_", "-")

"""The plan: every candidate strategy's memory and time for the job on the hardware, whether it fits,
and the fastest one that does. `plan` is pure given a ModelProfile (profile.py builds one without
memory); `plan_for_config` does both."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..common.precision import DTYPES
from ..settings.config import OPTIMIZER_STATES, PIPELINE_STRATEGIES, SPLIT_STRATEGIES, STATE_BYTES, STRATEGIES
from . import quantized
from .adapters import describe as describe_lora
from .automap import profile_for
from .devicecost import parameter_seconds, step_traffic
from .estimate import CACHE_SLACK, Estimate, combine, grad_bytes, memory, nvme_bytes, nvme_fill, step_time
from .hostcost import step_seconds as issue_seconds
from .keeping import choose_keeping, chunk_loss, recompute_share
from .workload import Workload
from .layouts import LayoutCandidate, Rejected, choose, layout_rows
from .profile import as_compiled, profile_model
from .rows import Candidate, fit_problem as _fit, gb as _gb, gpu_cap, host_problem as _host_fit, roomy
from .device_map_row import device_map_row
from .pipeline_row import pipeline_row

ALL = STRATEGIES + SPLIT_STRATEGIES + PIPELINE_STRATEGIES
# rows traced at one process's whole micro-batch, each device with its own bytes (not one share per GPU)
WHOLE = SPLIT_STRATEGIES + PIPELINE_STRATEGIES


@dataclass
class Recommendation:
    candidates: list[Candidate]
    recommended: str | None
    reason: str
    hardware: str
    job: Workload
    notes: list[str] = field(default_factory=list)
    device_map: dict | None = None  # the device_map row's map and every device's bytes (planning/automap.py)
    pipeline: dict | None = None  # the pipeline row's layout, cut and every rank's bytes (pipeline_row.py)
    # composed plans (layouts.py), when asked for: every rated one (fitting first, fastest first), the
    # rejected ones, and the one recommended over every named row (None: a named row stays the pick)
    layouts: list[LayoutCandidate] | None = None
    layout_rejected: list[Rejected] = field(default_factory=list)
    layout_pick: LayoutCandidate | None = None
    layout_reason: str = ""
    params: float = 0  # the model's parameters, and those the optimizer steps (LoRA: its adapters alone)
    trainable_params: float = 0

    def to_json(self) -> dict:
        job = {**vars(self.job), "lora": asdict(self.job.lora) if self.job.lora else None}
        out = {"strategies": [c.to_json() for c in self.candidates], "recommended": self.recommended,
               "reason": self.reason, "hardware": self.hardware, "job": job, "notes": self.notes,
               "device_map": self.device_map, "pipeline": self.pipeline, "params": self.params,
               "trainable_params": self.trainable_params}
        if self.layouts is not None:
            out["composed"] = [c.to_json() for c in self.layouts]
            out["composed_rejected"] = [vars(r) for r in self.layout_rejected]
            out["composed_recommended"] = self.layout_pick.estimate.name if self.layout_pick else None
            out["composed_reason"] = self.layout_reason
        return out


AUTOCAST = ("single", "ddp", "zero1")  # mixed precision by autocast (the others cast the parameters)
FSDP = ("zero2", "zero3", "zero3-offload")  # the rows FSDP2 runs


def plan(prof, hw, job: Workload, strategies=ALL, autocast_prof=None, split_prof=None,
         layouts: dict | None = None) -> Recommendation:
    """`autocast_prof`: the model traced as autocast runs it (fp32 weights, casts per op), for the
    autocast strategies; `split_prof`: traced at one process's whole micro-batch, for device_map and
    pipeline (default `prof`, the same when there is one GPU); `prof` otherwise, traced at
    job.micro(world). `layouts`: None for the named rows alone, else the composed plans too, with
    these degrees fixed ({} for all: layouts.py). A 4-bit base (job.load_in_4bit) is rated with no
    composed plan: none runs it (quantized.py)."""
    world = hw.world_size
    accum = max(1, job.batch_size // (job.micro(world) * world))
    c = DTYPES[job.precision].itemsize
    tokens = job.batch_size * (job.seq_len + job.target_len)
    out, sections = [], {}
    for name in strategies:
        if name == "single" and world > 1:
            continue
        if name in WHOLE:
            row = _whole_row(name, split_prof or autocast_prof or prof, hw, job)
            why, sections[name] = row.no_fit or _host_fit(row.estimate, hw), row.section
            why = why or (quantized.unrunnable(prof, name, hw) if job.load_in_4bit else None)
            out.append(Candidate(row.estimate, why is None, why or row.not_candidate, tokens / row.estimate.step_time_s))
            continue
        rated = [_row(name, states, prof, autocast_prof, hw, job, c, accum, tokens) for states in _formats(name, job)]
        # the most exact format that fits (--optimizer-states auto), else the most frugal's reason
        e = next((r for r in rated if _fit(r, hw) is None), rated[-1])
        if e.states != rated[0].states:
            e.why_states = f"with {rated[0].states} states it {_fit(rated[0], hw)}"
        why = _fit(e, hw) or (quantized.unrunnable(prof, name, hw) if job.load_in_4bit else None)
        out.append(Candidate(e, why is None, why or _nothing_to_offload(name, hw), tokens / e.step_time_s))
    ok = sorted((c for c in out if not c.why_not), key=_rank)
    best = ok[0].estimate.name if ok else None
    why = _reason(ok[0], out, world, hw) if ok else _advice(out, job, hw) if out else "no named strategy was rated"
    result = Recommendation(out, best, why, hw.describe(), job, device_map=sections.get("device_map"),
                  pipeline=sections.get("pipeline"), params=prof.params, trainable_params=prof.trainable_params)
    if layouts is not None and job.load_in_4bit:
        result.layout_reason = ("not rated with --load-in-4bit (a 4-bit base is split by FSDP2 or into whole "
                                "layers by device_map and pipeline alone)")
    elif layouts is not None:
        result.layouts, result.layout_rejected = layout_rows(prof, hw, job, layouts)
        result.layout_pick, result.layout_reason = choose(out, result.layouts)
    return result


def _nothing_to_offload(name: str, hw) -> str | None:
    """Offload rows on a machine without GPUs fit (they run, as the tests' do) but are no candidate:
    the host already holds and steps everything, and their copies only add time."""
    if hw.device == "cpu" and "offload" in name:
        return "not a candidate without GPUs: the job already computes and keeps its states in host RAM"
    return None


def _formats(name: str, job: Workload) -> tuple[str, ...]:
    """The moments' formats a data-parallel row is rated with: the job's, or for the offload engine's
    rows with none given each from the most exact; fp32 for the rows that keep torch's states."""
    if not name.startswith("zero2-offload"):
        return ("fp32",)
    return (job.optimizer_states,) if job.optimizer_states else OPTIMIZER_STATES


def _whole_row(name: str, prof, hw, job: Workload):
    """device_map's or pipeline's row (device maps and pipeline stages run autocast over fp32 weights, as
    single does; traced at one process's whole micro-batch), its activations kept or every block
    checkpointed, the faster that fits, under --activations auto (a map fits by moving blocks to the
    host: the first way that fits need not be the faster; offload is not rated for them)."""
    prof = chunk_loss(prof, job, job.micro(1) * (job.target_len or job.seq_len))
    row = device_map_row if name in SPLIT_STRATEGIES else pipeline_row
    return choose_keeping(lambda j: row(prof, hw, j), lambda r: not (r.no_fit or _host_fit(r.estimate, hw)), job, prof,
                          offload=False, spills=True)


def _row(name: str, states: str, prof, autocast_prof, hw, job: Workload, c: int, accum: int, tokens: int) -> Estimate:
    """A data-parallel row's bytes and time, its offload engine's moments in `states`, its activations
    kept as the job says or, --activations auto, as keeping.choose_keeping takes for it; the loss chunked as
    --loss-chunk says (keeping.chunk_loss, at each process's micro-batch)."""
    out = job.micro(hw.world_size) * (job.target_len or job.seq_len)
    prof, autocast_prof = (chunk_loss(p, job, out) if p is not None else None for p in (prof, autocast_prof))
    return choose_keeping(lambda j: _rated(name, states, prof, autocast_prof, hw, j, c, accum, tokens),
                          lambda e: roomy(e, hw), job, prof, offload=hw.device == "cuda")


def _rated(name: str, states: str, prof, autocast_prof, hw, job: Workload, c: int, accum: int, tokens: int) -> Estimate:
    """A data-parallel row's bytes and time with the activations kept as `job` says."""
    world = hw.world_size
    gb = grad_bytes(job.precision, hw.cpu_adam_kernel) if name.startswith("zero2-offload") else 4
    kept = (job.nvme_host_gb * 1e9 if job.nvme_host_gb is not None
            else nvme_fill(prof, hw, job.offload_grads == "device", gb, states))
    traced = autocast_prof if name in AUTOCAST and autocast_prof else prof
    flags = job.checkpointed(prof.stacks, prof.n_blocks)
    gpu, host = memory(name, traced, hw, c, job.checkpointing, accum, grads_on_device=job.offload_grads == "device",
                       nvme_host=kept, grad_bytes=gb, four_bit=job.load_in_4bit, delayed=job.delayed_update,
                       states=states, blocks=flags, offload=job.offload_activations)
    offloaded = traced.offloaded(flags) * accum if job.checkpointing and job.offload_activations else 0.0
    # a 4-bit base's matmuls each dequantize their weight too: memory-bound, beside the trace's operators
    dequant = quantized.dequant_seconds(prof, hw, job, accum, quantized.store(name, hw)) if job.load_in_4bit else 0.0
    # the issue cost from the plain trace's operators: autocast's casts run inside the dispatcher,
    # cheaply (single measured faster than zero2 and zero3 in every host-bound H200 row); the GPU's
    # memory traffic from the trace as it runs (autocast's fp32 residual stream and casts move bytes)
    costs = step_time(name, prof, hw, c, recompute_share(prof, job), tokens, accum, nvme_host=kept, grad_bytes=gb,
                      issue=issue_seconds(prof, hw, job, accum, fsdp=name in FSDP),
                      traffic=step_traffic(traced, hw, job, job.batch_size / world) + dequant
                      + _parameter_traffic(name, traced, hw, job, accum), states=states, four_bit=job.load_in_4bit,
                      precision=job.precision, offloaded=offloaded)
    step_s = combine(costs, engine=_engine_mode(job) if name.startswith("zero2-offload") else None, accum=accum,
                     device=hw.device)
    return Estimate(name, gpu, host, step_s, costs,
                    nvme_bytes(prof.trainable_params, hw, kept, states) if name.endswith("nvme") else 0, states=states)


# device_map's and pipeline's times leave out what no GPU run has measured yet (small chunks run
# below full efficiency, sends overlap compute or not): a near tie goes to the measured data-parallel rows
SPLIT_MARGIN = 1.10


def _rank(c: Candidate) -> tuple[float, float, int]:
    """Fastest first; on a tie (communication hidden under compute) the one that communicates less,
    since hidden traffic still competes for the GPU (zero2 ran 3.6% faster than zero3 on 2 H200s
    where both were predicted compute-bound, benchmarks/RESULTS.md); then the one using less memory."""
    e = c.estimate
    return (round(e.step_time_s * (SPLIT_MARGIN if e.name in WHOLE else 1.0), 6), e.costs.get("communication", 0.0),
            e.per_gpu["total"])


def _reason(best: Candidate, cands: list[Candidate], world: int, hw) -> str:
    """Why the fastest that fits wins; device_map and pipeline against the data-parallel rows either way."""
    e, by = best.estimate, {c.estimate.name: c for c in cands}
    where = "on its fullest GPU" if e.name in WHOLE else "per GPU"
    text = (f"{e.name} is the fastest that fits: {e.step_time_s:.3f} s/step, {_gb(e.per_gpu['total'])} {where}, "
            f"bound by {e.bottleneck}") + _edge(e, hw)
    if e.states != "fp32":  # a compact format (--optimizer-states auto's choice: say what fp32 would need)
        text += (f", with {e.states} optimizer states ({STATE_BYTES[e.states]:.0f} bytes a parameter in host RAM "
                 f"with the fp32 master, {_gb(e.per_host['total'])} a node" + (f"; {e.why_states})" if e.why_states
                                                                                 else ")"))
    if e.name in WHOLE:
        others = sorted((c.estimate for c in cands if not c.why_not and c.estimate.name not in WHOLE),
                        key=lambda o: o.step_time_s)
        if all("offload" in o.name for o in others):
            text += "; no data-parallel strategy fits without offload"
        if others:
            text += f"; the fastest data-parallel one that fits, {others[0].name}, takes {others[0].step_time_s:.3f} s"
        return text
    for o in (by[n].estimate for n in WHOLE if n in by and not by[n].why_not):
        text += f"; {o.name} fits too but takes {o.step_time_s:.3f} s/step, bound by {o.bottleneck}" + (
            ", where data parallelism keeps every GPU busy at once" if o.name in SPLIT_STRATEGIES and world > 1 else "")
    return text


def _edge(e: Estimate, hw) -> str:
    """A word where a data-parallel row fills a GPU past what the caching allocator needs beside it: such
    a step runs only by flushing the allocator's cache (T5-large under zero2-offload on an H100, 2026-12-06:
    1.06-1.31 s a step at 192 samples, 99% of the budget, against 0.53 s at 160); micro-batch auto keeps off it."""
    budget = gpu_cap(hw)
    if e.name in WHOLE or hw.device != "cuda" or e.per_gpu["total"] <= (1 - CACHE_SLACK) * budget:
        return ""
    return (f" (at {e.per_gpu['total'] / budget:.0%} of the GPU's budget, within the {CACHE_SLACK:.0%} the caching "
            "allocator needs: its steps may run only by flushing that cache, up to twice as slow; a smaller "
            "micro-batch or --micro-batch-size auto keeps off the edge)")


def _engine_mode(job: Workload) -> str:
    """When the offload engine's host step runs (offload/engine.py): beside the next step
    (delayed), under backward (nothing needs the global norm first: no clipping, no fp16 scale), or
    after backward."""
    if job.delayed_update:
        return "delayed"
    return "eager" if not job.clipping and job.precision != "fp16" else "after-backward"


def _advice(cands: list[Candidate], job: Workload, hw) -> str:
    """Why nothing is recommended, every candidate's reason in it: those that fit the GPU but cannot run
    for another reason (host RAM, the NVMe, no GPUs, device_map's one node) each with theirs, then how
    far the most frugal of the rest is over, and what would help."""
    cap = gpu_cap(hw)
    # device_map's and pipeline's per-GPU figures are their fullest device: not comparable with the smallest GPU
    least = min([c for c in cands if c.estimate.name not in WHOLE] or cands,
                key=lambda c: c.estimate.per_gpu["total"])
    short = least.estimate.per_gpu["total"] - cap
    tips = []
    if not job.checkpointing and not job.choose_activations:  # auto: every row was rated checkpointed already
        tips.append("--activation-checkpointing")
    if job.micro(hw.world_size) > 1:
        tips.append("a smaller --micro-batch-size")
    tips += ["more GPUs (ZeRO-3 divides the model states by their number)", "zero3-offload with more host RAM"]
    held = [c for c in cands if c.fits or c.estimate.per_gpu["total"] <= cap]  # by the GPU: the reason is elsewhere
    unusable = "; ".join(f"{c.estimate.name} {c.why_not}" for c in held)
    if short <= 0:  # the most frugal fits the GPU but cannot run here (e.g. offload on a machine without GPUs)
        over = sorted((c.estimate for c in cands if c not in held), key=lambda e: e.per_gpu["total"])
        needs = ", ".join(f"{e.name} {_gb(e.per_gpu['total'])}" for e in over)
        rest = f"; over the {_gb(cap)} a GPU offers: {needs}; try {', '.join(tips)}" if over else ""
        return f"no candidate can run here: {unusable}{rest}"
    head = f"nothing else fits ({unusable})" if unusable else "nothing fits"
    return (f"{head}: the most frugal, {least.estimate.name}, is {_gb(short)} over per GPU (of the {_gb(cap)} "
            "each offers); try " + ", ".join(tips))


def _parameter_traffic(name: str, prof, hw, job: Workload, accum: int) -> float:
    """The GPU's once-a-step parameter traffic (devicecost.parameter_seconds) of a data-parallel row:
    none where the host steps (the offload rows), the states' share where FSDP2 or ZeRO-1 divide them."""
    if "offload" in name:
        return 0.0
    shards = hw.world_size if name in ("zero1", *FSDP) else 1
    gathers = {"zero2": 1, "zero3": 2}.get(name, 0)
    spared = quantized.gather_saving(prof, hw, accum, gathers) if job.load_in_4bit else 0.0  # NF4's gathers
    autocast = name in AUTOCAST and job.precision != "fp32"
    return parameter_seconds(prof, hw, job, shards, accum, autocast, gathers) - spared


def plan_for_config(model_config, hw, job: Workload, strategies=ALL, layouts: dict | None = None) -> Recommendation:
    if job.load_in_4bit:
        quantized.check(job.lora is not None, job.precision)
    prof, autocast, split = traces(model_config, hw, job, strategies, layouts)
    result = plan(prof, hw, job, strategies, autocast, split, layouts)
    micro, whole = job.micro(hw.world_size), [s for s in strategies if s in WHOLE]
    data_parallel = any(s not in WHOLE for s in strategies) or layouts is not None
    traced = ([f"micro-batch {micro}"] * data_parallel
              + [f"micro-batch {job.micro(1)} for {' and '.join(whole)} (whole micro-batch)"] * bool(split))
    result.notes.append(f"model: {prof.params / 1e6:.1f}M parameters, {prof.n_blocks} blocks; activations traced at "
                        + " and ".join(traced or [f"micro-batch {micro}"]))
    if job.lora:
        result.notes.append(describe_lora(job.lora, prof.params, prof.trainable_params))
    if job.load_in_4bit:
        result.notes.append(quantized.describe(prof))
    return result


def traces(model_config, hw, job: Workload, strategies=ALL, layouts: dict | None = None) -> tuple:
    """(the data-parallel trace, the autocast one or None, device_map's and pipeline's or None) that
    `plan` rates `strategies` (and the composed plans, `layouts` not None) on."""
    micro = job.micro(hw.world_size)
    lengths = (model_config, micro, job.seq_len, job.target_len or job.seq_len, job.precision, hw.device)
    # the data-parallel trace, at each process's micro-batch: the named data-parallel rows and the composed ones
    data_parallel = any(s not in WHOLE for s in strategies) or layouts is not None
    whole = [s for s in strategies if s in WHOLE]
    split = None
    # device_map's and pipeline's trace is the balancer's (planning/automap.py): one process's whole
    # micro-batch, CUDA's attention; with one GPU it is the data-parallel trace itself
    if whole and not (job.micro(1) == micro and hw.device == "cuda" and data_parallel):
        split = profile_for(model_config, job)
    prof = as_compiled(profile_model(*lengths, lora=job.lora), job.compile) if data_parallel else split
    mixed = job.precision != "fp32" and hw.device == "cuda" and any(s in AUTOCAST or s in WHOLE for s in strategies)
    autocast = as_compiled(profile_model(*lengths, autocast=True, lora=job.lora), job.compile) if mixed else None
    return prof, autocast, split

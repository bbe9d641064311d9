"""The plan: every candidate strategy's memory and time for the job on the hardware, whether it fits,
and the fastest one that does. `plan` is pure given a ModelProfile (profile.py builds one without
memory); `plan_for_config` does both."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import STRATEGIES
from ..precision import DTYPES
from .estimate import RESERVE, Estimate, combine, memory, nvme_bytes, step_time


@dataclass(frozen=True)
class Job:
    batch_size: int  # global samples per optimizer step
    seq_len: int  # tokens per sample (source side for encoder-decoders)
    target_len: int = 0  # decoder tokens per sample (encoder-decoders)
    micro_batch: int | None = None  # None: batch_size / world size
    precision: str = "bf16"
    checkpointing: bool = False
    delayed_update: bool = False  # zero2-offload's host step overlaps the next step
    clipping: bool = True  # a global gradient norm is needed before the host step (max_grad_norm > 0)

    def micro(self, world: int) -> int:
        """The micro-batch per process: given, or the whole per-process share (no accumulation)."""
        return self.micro_batch or max(1, self.batch_size // world)


@dataclass
class Candidate:
    estimate: Estimate
    fits: bool
    why_not: str | None
    tokens_per_s: float

    def to_json(self) -> dict:
        e = self.estimate
        return {"name": e.name, "fits": self.fits, "per_gpu_bytes": e.per_gpu, "per_host_bytes": e.per_host,
                "per_node_nvme_bytes": e.nvme,
                "step_time_s": e.step_time_s, "tokens_per_s": self.tokens_per_s, "bottleneck": e.bottleneck,
                "why_not": self.why_not}


@dataclass
class Plan:
    candidates: list[Candidate]
    recommended: str | None
    reason: str
    hardware: str
    job: Job
    notes: list[str] = field(default_factory=list)
    device_map: dict | None = None  # what device_map="auto" would choose on one node (device_map/auto.py)

    def to_json(self) -> dict:
        return {"strategies": [c.to_json() for c in self.candidates], "recommended": self.recommended,
                "reason": self.reason, "hardware": self.hardware, "job": vars(self.job), "notes": self.notes,
                "device_map": self.device_map}


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _fit(e: Estimate, hw) -> str | None:
    gpu_cap = min(hw.gpu_bytes) - RESERVE
    if e.per_gpu["total"] > gpu_cap:
        worst = max(("params", "grads", "optimizer", "activations", "buffers"), key=e.per_gpu.get)
        return (f"needs {_gb(e.per_gpu['total'])} per GPU, {_gb(e.per_gpu['total'] - gpu_cap)} more than the "
                f"smallest GPU offers (largest part: {worst} {_gb(e.per_gpu[worst])})")
    if e.per_host["total"] > hw.cpu_ram * 0.9:
        return f"needs {_gb(e.per_host['total'])} of host RAM per node, more than 90% of {_gb(hw.cpu_ram)}"
    if e.nvme > hw.nvme:
        return f"needs {_gb(e.nvme)} of NVMe per node for optimizer states; --nvme gives {_gb(hw.nvme)}"
    return None


AUTOCAST = ("single", "ddp", "zero1")  # mixed precision by autocast (the others cast the parameters)


def plan(prof, hw, job: Job, strategies=STRATEGIES, autocast_prof=None) -> Plan:
    """`autocast_prof`: the model traced as autocast runs it (fp32 weights, casts per op), for the
    autocast strategies; `prof` otherwise."""
    world = hw.world_size
    accum = max(1, job.batch_size // (job.micro(world) * world))
    c = DTYPES[job.precision].itemsize
    tokens = job.batch_size * (job.seq_len + job.target_len)
    out = []
    for name in strategies:
        if name == "single" and world > 1:
            continue
        gpu, host = memory(name, autocast_prof if name in AUTOCAST and autocast_prof else prof, hw, c,
                           job.checkpointing, accum)
        costs = step_time(name, prof, hw, c, job.checkpointing, tokens, accum)
        step_s = combine(costs, engine=_engine_mode(job) if name.startswith("zero2-offload") else None, accum=accum)
        e = Estimate(name, gpu, host, step_s, costs, nvme_bytes(prof.params, hw) if name.endswith("nvme") else 0)
        why = _fit(e, hw)
        out.append(Candidate(e, why is None, why, tokens / e.step_time_s))
    fitting = sorted((c for c in out if c.fits), key=lambda c: (c.estimate.step_time_s, c.estimate.per_gpu["total"]))
    if fitting:
        best = fitting[0]
        reason = (f"{best.estimate.name} is the fastest that fits: {best.estimate.step_time_s:.3f} s/step, "
                  f"{_gb(best.estimate.per_gpu['total'])} per GPU, bound by {best.estimate.bottleneck}")
        return Plan(out, best.estimate.name, reason, hw.describe(), job)
    return Plan(out, None, _advice(out, job, hw), hw.describe(), job)


def _engine_mode(job: Job) -> str:
    """When the offload engine's host step runs (strategies/offload.py): beside the next step
    (delayed), under backward (nothing needs the global norm first: no clipping, no fp16 scale), or
    after backward."""
    if job.delayed_update:
        return "delayed"
    return "eager" if not job.clipping and job.precision != "fp16" else "after-backward"


def _advice(cands: list[Candidate], job: Job, hw) -> str:
    least = min(cands, key=lambda c: c.estimate.per_gpu["total"])
    short = least.estimate.per_gpu["total"] - (min(hw.gpu_bytes) - RESERVE)
    tips = []
    if not job.checkpointing:
        tips.append("--activation-checkpointing")
    if (job.micro_batch or 2) > 1:
        tips.append("a smaller --micro-batch-size")
    tips += ["more GPUs (ZeRO-3 divides the model states by their number)", "zero3-offload with more host RAM"]
    return (f"nothing fits: the most frugal, {least.estimate.name}, is {_gb(short)} over per GPU; try "
            + ", ".join(tips))


def plan_for_config(model_config, hw, job: Job, strategies=STRATEGIES) -> Plan:
    from .profile import profile_model

    micro = job.micro(hw.world_size)
    lengths = (model_config, micro, job.seq_len, job.target_len or job.seq_len, job.precision, hw.device)
    prof = profile_model(*lengths)
    mixed = job.precision != "fp32" and hw.device == "cuda" and any(s in AUTOCAST for s in strategies)
    result = plan(prof, hw, job, strategies, profile_model(*lengths, autocast=True) if mixed else None)
    result.notes.append(f"model: {prof.params / 1e6:.1f}M parameters, {prof.n_blocks} blocks; activations traced at "
                        f"micro-batch {micro}")
    return result

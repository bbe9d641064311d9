"""A rated row of the plan (a named strategy or a composed layout) and whether its bytes fit the machine."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .estimate import CACHE_SLACK, KEYS, RESERVE, Estimate


@dataclass
class Candidate:
    estimate: Estimate
    fits: bool  # every device within its budget, host RAM and NVMe too
    why_not: str | None  # why it cannot be recommended: it does not fit, or (device_map) would not split
    tokens_per_s: float

    def to_json(self) -> dict:
        e = self.estimate
        return {"name": e.name, "fits": self.fits, "per_gpu_bytes": e.per_gpu, "per_host_bytes": e.per_host,
                "per_node_nvme_bytes": e.nvme, "optimizer_states": e.states, "activations": e.activations,
                "checkpoint_blocks": e.checkpoint_blocks,
                "step_time_s": e.step_time_s, "tokens_per_s": self.tokens_per_s, "bottleneck": e.bottleneck,
                "why_not": self.why_not}


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def with_slack(hw):
    """`hw` with CACHE_SLACK of each GPU's budget (past the reserve) left to the caching allocator: the
    machine micro-batch auto and --max-seq-len fill (job/autoplan.py, longest.py)."""
    return replace(hw, gpu_bytes=tuple(RESERVE + int((1 - CACHE_SLACK) * (b - RESERVE)) for b in hw.gpu_bytes))


def gpu_cap(hw) -> int:
    """The bytes a plan may use on the smallest GPU: its memory less the reserve."""
    return min(hw.gpu_bytes) - RESERVE


def fit_problem(e: Estimate, hw) -> str | None:
    """Why `e` does not fit: its GPU bytes against the smallest GPU (less the reserve), or the host's."""
    cap = gpu_cap(hw)
    if e.per_gpu["total"] > cap:
        worst = max(KEYS, key=e.per_gpu.get)
        return (f"needs {gb(e.per_gpu['total'])} per GPU, {gb(e.per_gpu['total'] - cap)} more than the {gb(cap)} "
                f"the smallest GPU offers (largest part: {worst} {gb(e.per_gpu[worst])})")
    return host_problem(e, hw)


def roomy(e: Estimate, hw) -> bool:
    """`e` fits with CACHE_SLACK of a GPU's budget left to the caching allocator (estimate.py): where
    --activations auto chooses how many blocks to checkpoint, the fewest that barely fit would run only
    by flushing the allocator's cache (up to twice as slow), which a block more to recompute avoids."""
    edge = hw.device == "cuda" and e.per_gpu["total"] > (1 - CACHE_SLACK) * gpu_cap(hw)
    return fit_problem(e, hw) is None and not edge


def host_problem(e: Estimate, hw) -> str | None:
    if e.per_host["total"] > hw.cpu_ram * 0.9:
        return f"needs {gb(e.per_host['total'])} of host RAM per node, more than 90% of {gb(hw.cpu_ram)}"
    if e.nvme > hw.nvme:
        return f"needs {gb(e.nvme)} of NVMe per node for optimizer states; the disk offers {gb(hw.nvme)} (--nvme)"
    return None

"""A rated row of the plan (a named strategy or a composed layout) and whether its bytes fit the machine."""
from __future__ import annotations

from dataclasses import dataclass

from .estimate import KEYS, RESERVE, Estimate


@dataclass
class Candidate:
    estimate: Estimate
    fits: bool  # every device within its budget, host RAM and NVMe too
    why_not: str | None  # why it cannot be recommended: it does not fit, or (device_map) would not split
    tokens_per_s: float

    def to_json(self) -> dict:
        e = self.estimate
        return {"name": e.name, "fits": self.fits, "per_gpu_bytes": e.per_gpu, "per_host_bytes": e.per_host,
                "per_node_nvme_bytes": e.nvme, "optimizer_states": e.states,
                "step_time_s": e.step_time_s, "tokens_per_s": self.tokens_per_s, "bottleneck": e.bottleneck,
                "why_not": self.why_not}


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


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


def host_problem(e: Estimate, hw) -> str | None:
    if e.per_host["total"] > hw.cpu_ram * 0.9:
        return f"needs {gb(e.per_host['total'])} of host RAM per node, more than 90% of {gb(hw.cpu_ram)}"
    if e.nvme > hw.nvme:
        return f"needs {gb(e.nvme)} of NVMe per node for optimizer states; the disk offers {gb(hw.nvme)} (--nvme)"
    return None

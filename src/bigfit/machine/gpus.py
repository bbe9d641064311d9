"""What a named GPU holds, computes and moves, for the planner: `bigfit plan --gpus 8xH100` and a
machine's own GPUs (hardware.detect, by torch's device name).

The planner's rates were fitted on the H200 machine (hardware.DEFAULTS: 760 TFLOP/s reached of its 989
dense bf16, 4800 GB/s of HBM3e at devicecost.MEM_EFFICIENCY). Another GPU's rates are those scaled by
its datasheet, so that the fitted shares carry over: an H100 SXM computes as fast and moves 3350 GB/s,
and `bigfit bench`'s T5-large rows (single, zero3) took 1.2x the H200's time a sample on one
(benchmarks/RESULTS.md, 2026-12-05).
A GPU not listed here keeps the H200's rates, and the plan's notes say so; `--gpu-tflops` and
`--gpu-mem-gbps` describe it."""
from __future__ import annotations

from dataclasses import dataclass

H200_TFLOPS = 989.0  # the H200's dense bf16 datasheet peak, which hardware.DEFAULTS' gpu_tflops was fitted against


@dataclass(frozen=True)
class Gpu:
    match: str  # what torch.cuda.get_device_name contains (the first entry that matches wins)
    name: str  # what --gpus takes: 8xH100
    memory_gib: float  # as torch reports its total memory
    tflops: float  # dense bf16, datasheet
    mem_gbps: float  # datasheet


# more specific names first: "H100 NVL" before "H100", "L40S" and "L40" before "L4"
KNOWN = (
    Gpu("H200", "H200", 140.4, 989, 4800),
    Gpu("H100 NVL", "H100-NVL", 93.0, 835, 3900),
    Gpu("H100 PCIe", "H100-PCIE", 79.6, 756, 2000),
    Gpu("H100", "H100", 79.6, 989, 3350),
    Gpu("B200", "B200", 179.0, 2250, 8000),
    Gpu("A100-SXM4-80GB", "A100-80GB", 79.3, 312, 2039),
    Gpu("A100 80GB PCIe", "A100-80GB-PCIE", 79.3, 312, 1935),
    Gpu("A100", "A100-40GB", 39.6, 312, 1555),
    Gpu("L40S", "L40S", 45.0, 362, 864),
    Gpu("L40", "L40", 45.0, 181, 864),
    Gpu("L4", "L4", 22.5, 121, 300),
    Gpu("RTX 4090", "RTX4090", 24.0, 165, 1008),
    Gpu("RTX 3090", "RTX3090", 24.0, 71, 936),
)


def by_device_name(device_name: str) -> Gpu | None:
    """The entry for torch's name of a device ("NVIDIA H100 80GB HBM3"), or None."""
    return next((g for g in KNOWN if g.match.lower() in device_name.lower()), None)


def by_name(name: str) -> Gpu | None:
    """The entry --gpus names ("H100", case aside), or None."""
    return next((g for g in KNOWN if g.name.lower() == name.strip().lower()), None)


def rates(gpus: list[Gpu], h200_tflops: float) -> dict:
    """Hardware's gpu_tflops and gpu_mem_gbps for a node of these GPUs: the slowest one's (a step
    waits for it), its datasheet peak scaled by what the H200 reached of its own (`h200_tflops`);
    {} for none."""
    if not gpus:
        return {}
    slow = min(gpus, key=lambda g: (g.tflops, g.mem_gbps))
    return {"gpu_tflops": h200_tflops * slow.tflops / H200_TFLOPS, "gpu_mem_gbps": float(slow.mem_gbps)}


def names() -> str:
    return ", ".join(g.name for g in KNOWN)

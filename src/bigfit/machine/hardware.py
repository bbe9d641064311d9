"""Descriptions of the machines a job may run on: detected, or given as `--gpus 8x16GB`,
`--gpus 24GB,8GB`, `--nodes 2`, `--cpu-ram 256GB`, `--nvme 1TB`. Pure data; `detect` is the one
function that looks at the machine."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..common.units import gpu_cap, parse_size  # noqa: F401  parse_size: hardware's public name too
from ..errors import BigfitError
from . import gpus as known_gpus

# Defaults for what cannot be detected, from measurements on the lent H200 machine (NOTES-machines.md):
# pinned PCIe ~55 GB/s each way, bf16 dense matmul ~760 TFLOP/s, fused CPU AdamW ~4 G params/s on 16 cores,
# 2.2 TFLOP/s of training (forward + backward, bf16 autocast) on those cores beside a sweep of the blocks'
# weights each pass (planning/device_map_row.py HOST_SWEEP_S), fitted together on T5-large's device maps over
# cuda:0 + cpu at batch 8-128 (benchmarks/RESULTS.md, 2026-12-04).
# host_op_us: the host's microseconds per forward operator of an eager training step, its backward
# included (planning/hostcost.py): T5-large's ~10,300 traced forward operators took the H200 machine's
# host about 0.3 s per micro-batch (29 us), `bigfit plan --calibrate` 22-24 us there on a small Llama;
# it measures this machine's.
DEFAULTS = dict(gpu_tflops=760.0, pcie_gbps=55.0, intra_gbps=300.0, inter_gbps=25.0, cpu_adam_params_per_s=4e9,
                nvme_gbps=3.0, cpu_tflops=2.2, host_op_us=25.0, gpu_mem_gbps=4800.0)  # nvme: a typical PCIe 4 drive, not measured here
# gloo's all_reduce between the local processes of a machine without GPUs, bus bandwidth (2 (n - 1) / n
# of the bytes over the time): 0.64 GB/s at 4 MB, 1.1 at 16 MB, 1.2 at 64 MB between 2 processes of one
# thread each on a 2-core machine (2026-12-05): about 1 GB/s at the sizes that matter, DDP's 25 MB
# buckets and FSDP2's units. Their intra_gbps (planning/estimate.py rates the collectives by it).
GLOO_LOCAL_GBPS = 1.0
# A CPU job's host_op_us where `bigfit plan --calibrate` has not measured this machine's: dispatch and
# autograd with no kernel launch, 6.7 us on the 2-core machine (2026-12-05, commands/calibrate.py's measure on its
# CPU); the H200 host's 25 us read the embedded T5's steps of 64 samples 1.6x slow there.
CPU_HOST_OP_US = 7.0
# Beyond these a description is a typo, far past any real machine (and a list of 10**11 GPU sizes would
# not fit in RAM: parse_gpus builds one per node).
MAX_GPUS_PER_NODE = 1024
MAX_NODES = 100_000


def parse_gpus(text: str) -> list[int]:
    """'8x16GB' -> eight 16 GB devices; '24GB,8GB' -> two devices of different sizes (one node's);
    '8xH100' -> eight of a GPU the planner knows (gpus.py), its memory as torch reports it."""
    return [size for size, _ in _gpu_parts(text)]


def gpu_rates(text: str) -> dict:
    """The rates of the GPUs --gpus names (gpus.rates: the slowest's), {} where it gives sizes only."""
    return known_gpus.rates([g for _, g in _gpu_parts(text) if g is not None], DEFAULTS["gpu_tflops"])


def _gpu_parts(text: str) -> list[tuple[int, known_gpus.Gpu | None]]:
    out = []
    for part in text.split(","):
        count, _, size = part.strip().replace("X", "x").rpartition("x")
        n = int(count) if count.strip().isdigit() else 1 if not count else None
        if n is None or n < 1:
            raise BigfitError(f"--gpus {text!r}: write a list like 8x16GB or 24GB,8GB")
        if len(out) + n > MAX_GPUS_PER_NODE:  # checked before the list is built: 99999999999x16GB
            raise BigfitError(f"--gpus {text!r} describes {len(out) + n} GPUs in one node; at most "
                              f"{MAX_GPUS_PER_NODE} per node: give more nodes with --nodes (8x80GB --nodes 4)")
        named = known_gpus.by_name(size)
        if named is None and not size.strip()[:1].isdigit():
            raise BigfitError(f"--gpus {text!r}: {size.strip()!r} is neither a size (16GB) nor a GPU bigfit "
                              f"knows ({known_gpus.names()})")
        gpu = int(named.memory_gib * 2**30) if named else parse_size(size, "--gpus size")
        if gpu <= 0:
            raise BigfitError(f"--gpus {text!r}: a GPU of {size.strip()!r} holds nothing; give each "
                              "GPU's memory, like 16GB")
        out += [(gpu, named)] * n
    return out


@dataclass(frozen=True)
class Hardware:
    gpu_bytes: tuple[int, ...]  # memory of each GPU of one node (mixed sizes allowed)
    nodes: int = 1
    cpu_ram: int = 64 * 10**9  # host RAM of one node
    nvme: int = 0  # NVMe bytes of one node usable for offload
    gpu_tflops: float = DEFAULTS["gpu_tflops"]  # dense bf16 peak of one GPU
    gpu_mem_gbps: float = DEFAULTS["gpu_mem_gbps"]  # one GPU's memory bandwidth (the H200's HBM3e: 4.8 TB/s)
    pcie_gbps: float = DEFAULTS["pcie_gbps"]  # host <-> GPU, each way, per GPU
    intra_gbps: float = DEFAULTS["intra_gbps"]  # GPU <-> GPU inside a node (bus bandwidth)
    inter_gbps: float = DEFAULTS["inter_gbps"]  # between nodes, per node
    nvme_gbps: float = DEFAULTS["nvme_gbps"]  # NVMe read or write bandwidth of one node
    cpu_adam_params_per_s: float = DEFAULTS["cpu_adam_params_per_s"]  # host optimizer speed, one node
    cpu_tflops: float = DEFAULTS["cpu_tflops"]  # model FLOP/s the host reaches training blocks mapped to it, in T
    host_op_us: float = DEFAULTS["host_op_us"]  # host microseconds to issue a forward operator (and its backward)
    device: str = "cuda"  # what the "GPUs" are: "cpu" when a CPU-only machine plans for itself
    cpu_adam_kernel: bool = True  # bigfit's host Adam kernel builds (a C compiler): offload gradients travel in bf16
    # the kernel's parameters a second per optimizer-state format, measured (bigfit plan --calibrate);
    # () rates its step by the bytes it moves against cpu_adam_params_per_s (planning/estimate.py)
    host_adam_rates: tuple[tuple[str, float], ...] = ()
    # `--device-map {"auto": budgets}`: the devices and bytes device_map's balancer may use, in place
    # of this machine's GPUs and RAM (planning/device_map_row.py budgets)
    map_budgets: tuple[tuple[str, int], ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if not self.gpu_bytes:
            raise BigfitError("no GPUs described; give --gpus like 8x16GB (or run on a machine with GPUs)")
        if self.nodes < 1:
            raise BigfitError(f"--nodes must be at least 1, got {self.nodes}")

    @property
    def gpus_per_node(self) -> int:
        return len(self.gpu_bytes)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        sizes = sorted(set(self.gpu_bytes), reverse=True)
        gpus = ", ".join(f"{self.gpu_bytes.count(s)}x{s / 1e9:.0f}GB" for s in sizes)
        h200 = (self.gpu_tflops, self.gpu_mem_gbps) == (DEFAULTS["gpu_tflops"], DEFAULTS["gpu_mem_gbps"])
        rated = "" if self.device == "cpu" else (f"; each GPU rated{' as an H200' * h200} {self.gpu_tflops:.0f} "
                                                  f"TFLOP/s and {self.gpu_mem_gbps:.0f} GB/s")
        return (f"{self.nodes} node(s) x [{gpus}], host RAM {self.cpu_ram / 1e9:.0f} GB per node"
                + (f", NVMe {self.nvme / 1e12:.1f} TB" if self.nvme else "") + rated)


def calibration_path() -> Path:
    """Where `bigfit plan --calibrate` keeps this machine's measured host figures."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "bigfit" / "host.json"


# Figures measured in this process that the cache could not keep (calibration.write_cache: a read-only
# cache directory): they stand in for the file's, so that `bigfit plan --calibrate` plans with them.
_UNKEPT: dict = {}


def keep_unkept(records: dict) -> None:
    _UNKEPT.update(records)


def unkept() -> dict:
    return dict(_UNKEPT)


def _calibrated(device: str) -> dict:
    """The kept record for jobs on `device` ("cuda" or "cpu"), or {}: not calibrated, or a calibration
    file that cannot be read, which is ignored (the defaults stand), never an error."""
    if isinstance(_UNKEPT.get(device), dict):
        return _UNKEPT[device]
    try:
        record = json.loads(calibration_path().read_text())[device]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return record if isinstance(record, dict) else {}


def calibrated_host_op_us(device: str) -> float | None:
    """This machine's measured host_op_us for jobs on `device`, if calibrated."""
    try:
        value = float(_calibrated(device)["host_op_us"])
    except (KeyError, TypeError, ValueError):
        return None
    return value if value > 0 else None


def calibrated_host_adam(device: str) -> dict[str, float]:
    """This machine's measured host Adam rates for jobs on `device` (calibration.py, offload/adamrate.py:
    "torch" and each kernel format, parameters a second), or {}."""
    try:
        rates = {str(k): float(v) for k, v in _calibrated(device)["host_adam"].items()}
    except (KeyError, AttributeError, TypeError, ValueError):
        return {}
    return rates if rates and all(v > 0 for v in rates.values()) else {}


def host_figures(device: str) -> dict:
    """Hardware's host figures for jobs on `device`: this machine's where `bigfit plan --calibrate`
    measured them, else the defaults (the H200 machine's)."""
    adam = calibrated_host_adam(device)
    out = {"host_op_us": calibrated_host_op_us(device) or DEFAULTS["host_op_us"],
           "host_adam_rates": tuple((f, r) for f, r in sorted(adam.items()) if f != "torch")}
    if "torch" in adam:
        out["cpu_adam_params_per_s"] = adam["torch"]
    return out


def cpu_host_figures() -> dict:
    """host_figures for the processes of a machine without GPUs: uncalibrated, CPU_HOST_OP_US."""
    return {**host_figures("cpu"), "host_op_us": calibrated_host_op_us("cpu") or CPU_HOST_OP_US}


def host_notes(device: str) -> tuple[str, ...]:
    """What `bigfit plan` says of the host figures it used."""
    op_us, adam = calibrated_host_op_us(device), calibrated_host_adam(device)
    source = "calibrated" if op_us else "the H200 machine's; bigfit plan --calibrate measures this one's"
    notes = [f"host {op_us or DEFAULTS['host_op_us']:.1f} us per operator issued ({source})"]
    if adam:
        notes.append("host Adam G parameters/s (calibrated): " + ", ".join(
            f"{'torch fused' if f == 'torch' else f}: {r / 1e9:.2f}" for f, r in adam.items()))
    return tuple(notes)


def host_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def detect() -> Hardware:
    """This machine: its CUDA devices and host RAM (one node)."""
    # imported here: torch and the host Adam kernel's module (which builds or finds the kernel), which
    # `bigfit plan --gpus ...` and the planner's importers (the launcher, device_map) need not load
    import torch

    from ..kernels import cpu_adam

    cap = gpu_cap() or 2**63
    gpus = tuple(min(cap, torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count()))
    if not gpus:
        raise BigfitError("no GPU found on this machine; describe the target with --gpus (e.g. --gpus 8x16GB)")
    rates, note = _device_rates([torch.cuda.get_device_name(i) for i in range(len(gpus))])
    return Hardware(gpu_bytes=gpus, cpu_ram=host_ram(), cpu_adam_kernel=cpu_adam.kernel() is not None,
                    **host_figures("cuda"), **rates,
                    notes=(f"detected {os.cpu_count()} CPU cores", note, *host_notes("cuda")))


def _device_rates(names: list[str]) -> tuple[dict, str]:
    """The rates of the GPUs torch names (gpus.py), and a note; the H200's where one is unknown."""
    found = [known_gpus.by_device_name(n) for n in names]
    if None in found:
        unknown = names[found.index(None)]
        return {}, (f"{unknown}: not in bigfit's table of GPUs; rated as an H200 (--gpu-tflops, --gpu-mem-gbps "
                    "describe it)")
    rates = known_gpus.rates(found, DEFAULTS["gpu_tflops"])
    return rates, (f"{names[0]}: rated {rates['gpu_tflops']:.0f} TFLOP/s (bf16, as the H200's 760 of 989) and "
                   f"{rates['gpu_mem_gbps']:.0f} GB/s of memory")

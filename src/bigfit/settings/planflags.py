"""`bigfit plan`'s own settings, declared without loading torch or the planner: the machine it rates and
what it writes. The job it rates is `bigfit train`'s TrainConfig (config.PLAN_TAKES says which fields);
reading.py declares them all as one schema and cli.py builds every parser from it. Field comments are
the `--help` texts."""
from __future__ import annotations

from dataclasses import dataclass

from .config import AT_LEAST_0, RANGES

LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")


@dataclass(frozen=True)
class PlanHardware:
    """The machine a plan rates: GPUs described by --gpus, else this machine as `bigfit train` sees it."""

    # e.g. 8x16GB, 24GB,8GB (mixed sizes) or 8xH100 (a GPU bigfit knows: its memory and rates); None: this
    # machine's GPUs, one per process (--nproc), or on a machine without GPUs its CPU shared by the processes
    gpus: str | None = None
    nodes: int = 1  # nodes, each with --gpus
    cpu_ram: str | None = None  # host RAM per node, e.g. 256GB; None: this machine's
    nvme: str = "0B"  # NVMe per node usable for offload, e.g. 1TB
    gpu_tflops: float | None = None  # dense bf16 TFLOP/s one GPU reaches (the H200: 760 of its 989); None: its GPU's
    gpu_mem_gbps: float | None = None  # one GPU's memory bandwidth, GB/s; None: its GPU's
    pcie_gbps: float | None = None  # host <-> GPU bandwidth per GPU, GB/s
    intra_gbps: float | None = None  # GPU <-> GPU bandwidth inside a node, GB/s
    inter_gbps: float | None = None  # bandwidth between nodes, GB/s
    nvme_gbps: float | None = None  # NVMe bandwidth of one node, GB/s
    cpu_tflops: float | None = None  # model TFLOP/s the host reaches on blocks a device map puts there
    # host microseconds to issue one forward operator and its backward in eager mode; None: this machine's
    # from --calibrate, else the H200 machine's 25
    host_op_us: float | None = None
    # measure this machine's --host-op-us on its GPU (or CPU), keep it in the cache ($XDG_CACHE_HOME/bigfit;
    # one that cannot be written: for this plan only), then plan
    calibrate: bool = False


@dataclass(frozen=True)
class PlanOutput:
    """How `bigfit plan` shows the plan: the table and the job it rated, or JSON; a PNG beside."""

    json: bool = False  # print the plan, and the job it rated, as one JSON object
    # for each strategy and composed layout, the longest sequence a sample predicted to fit (at the job's
    # micro-batch, 1 unless given) and how its activations are kept there, in place of the plan
    max_seq_len: bool = False
    plot: str | None = None  # write per-GPU memory bars to this PNG


# `bigfit plan`'s names for two of the job's settings, kept: issue texts and users write them
ALIASES = {"seq_len": "max_source_len", "target_len": "max_target_len"}
# The job's ranges as `bigfit plan` checks them: TrainConfig's (config.RANGES), but 0 target tokens, which
# the planner rates as many as the source's (what `--target-len 0` has always meant). The machine's
# numbers are checked where it is described (commands/plan.py hardware_of).
PLAN_RANGES = {**RANGES, "max_target_len": AT_LEAST_0}

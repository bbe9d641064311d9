"""The process layout of one run and the few collectives the loop needs.

One process with no process group is the natural special case: every helper here works with
`world_size == 1` and then does no communication at all. Several processes are found through the
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which torchrun,
accelerate and bigfit's own launchers set, and which launchers.from_slurm fills from SLURM's for the
tasks of an srun step: each helper that reads it first calls from_slurm.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .launchers import from_slurm
from .processes import allowed_cores
from .units import gpu_cap


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool = False  # this Runtime created the process group and destroys it at shutdown
    group: object = None  # the process group of this view's collectives; None: every process
    mesh: object = None  # the job's named DeviceMesh (pp, dp_replicate, dp_shard, tp), once planned (layout/mesh.py)
    data_view: "Runtime | None" = None  # this rank among the data-parallel ranks; None: among all ranks

    @property
    def data(self) -> "Runtime":
        """The ranks the global batch is divided over, and this rank's place among them: every rank,
        unless pipeline or tensor-parallel ranks share a data shard."""
        return self.data_view or self

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun_env() -> bool:
    """True when this process is one worker of a multi-process job (torchrun, bigfit's launcher, srun)."""
    from_slurm()
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def cores_per_rank() -> int:
    """Threads for this rank's own host work (the offload engine's Adam, checkpoint checksums): its
    share of the cores it may run on. Not torch's intra-op count: torchrun sets OMP_NUM_THREADS=1
    when a node runs several ranks, which would leave each rank on one core. Ranks already pinned to
    fewer cores than the machine's get them all."""
    from_slurm()
    allowed = allowed_cores()
    if allowed < (os.cpu_count() or 1):
        return allowed
    return max(1, allowed // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def world_size() -> int:
    """Processes in this job, from the torchrun environment (1 without one)."""
    from_slurm()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_runtime(timeout_s: float = 300.0, group_for_one: bool = False, host_collectives: bool = False) -> Runtime:
    """Join the job's process group (NCCL on GPUs, gloo on CPUs) with a collective timeout, so that
    a dead or stuck peer fails this process instead of hanging it for the default 30 minutes.
    One process gets a group only when asked (`group_for_one`: FSDP2 needs a mesh even for one rank,
    to offload or to cast parameters); it lives in memory (HashStore), with no network."""
    world = world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if cap := gpu_cap():  # a smaller card, simulated: the allocator raises out-of-memory past it
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    else:
        device = torch.device("cpu")
    owns = (world > 1 or group_for_one) and not dist.is_initialized()  # an embedding program may have joined
    if owns:
        backend = "gloo" if device.type != "cuda" else "cpu:gloo,cuda:nccl" if host_collectives else "nccl"
        store = dist.HashStore() if world == 1 else None
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), store=store,
            device_id=device if device.type == "cuda" else None)
    return Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device, owns_group=owns)


def shutdown(rt: Runtime) -> None:
    if rt.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], rt: Runtime) -> list[float]:
    """Sum a few numbers over the ranks of `rt` (a float64 tensor on the job's device)."""
    if not rt.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=rt.device)
    dist.all_reduce(t, group=rt.group)
    return t.tolist()


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier()


def broadcast_object(obj, rt: Runtime):
    """Rank 0's `obj` on every rank."""
    if not rt.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj, rt: Runtime) -> list | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
    if not rt.distributed:
        return [obj]
    out = [None] * rt.world_size if rt.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out

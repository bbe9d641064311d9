"""The named DeviceMesh of a plan, and the data-parallel view of this rank inside it.

The mesh has every dimension of the plan (`pp`, `dp_replicate`, `dp_shard`, `cp`, `tp`, outermost first),
degree 1 included, so that code asks for a dimension by name whatever the layout: FSDP2 shards over
`dp_shard` (HSDP: `dp_replicate` x `dp_shard`; with context parallelism `dp_shard` x `cp`), DTensor
splits over `tp`, pipeline stages talk over `pp`, attention gathers keys and values over `cp`.
Neighbouring ranks share the innermost dimension: tensor parallelism, the most talkative,
stays inside a node. One process without a process group has no mesh: its data view is itself.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..common.distributed import Runtime
from .plan import DIMS, ParallelPlan


_made: dict = {}  # (device type, degrees) -> (mesh, data view), for the process group they were made in
_run_groups: list = []  # the groups made for the run in progress alone (run_group), this rank's


def with_mesh(rt: Runtime, plan: ParallelPlan) -> Runtime:
    """`rt` with the plan's mesh and this rank's data-parallel view (collective: every rank calls it).
    Made once per layout and process group: each mesh holds a process group per dimension, which
    lives as long as the job's, and a process that runs job after job in one group (a notebook, the
    tests' kept ranks) would otherwise gather hundreds of them."""
    if not dist.is_initialized():
        return rt
    key = (rt.device.type, tuple(getattr(plan, d) for d in DIMS))
    world, made = _made.get(key, (None, None))
    if world is not dist.group.WORLD:
        mesh = init_device_mesh(rt.device.type, key[1], mesh_dim_names=DIMS)
        made = (mesh, _data_view(rt, plan, mesh))
        _made[key] = (dist.group.WORLD, made)
    return dataclasses.replace(rt, mesh=made[0], data_view=made[1])


def _data_view(rt: Runtime, plan: ParallelPlan, mesh) -> Runtime | None:
    """Among the data-parallel ranks of this rank's (pp, tp) position: rank = replica x shards + shard."""
    if plan.dp == plan.world:
        return None  # every rank holds its own data shard: the world is the view
    pp, rep, shard, cp, tp = mesh.get_coordinate()
    group = dist.new_subgroups_by_enumeration(_data_ranks(mesh))[0] if plan.dp > 1 else None  # collective
    return Runtime(rank=rep * plan.dp_shard + shard, world_size=plan.dp, local_rank=rt.local_rank, device=rt.device,
                   group=group)


def _data_ranks(mesh) -> list[list[int]]:
    """Each (pp, cp, tp) position's data-parallel ranks, in the same order on every rank."""
    pp, _, _, cp, tp = mesh.mesh.shape
    return [mesh.mesh[p, :, :, c, t].flatten().tolist() for p in range(pp) for c in range(cp) for t in range(tp)]


def new_data_group(rt: Runtime):
    """A process group of its own over this rank's data-parallel ranks (collective: every rank of
    the job calls it, also those of other pipeline positions): for engines whose collectives must
    not share a group with others (the offload engine's two streams). None for one data rank."""
    if rt.data.world_size == 1:
        return None
    if rt.data_view is None:
        return run_group(None)
    enumeration = _data_ranks(rt.mesh)
    groups = [run_group(ranks) for ranks in enumeration]  # every rank makes every one, in the same order
    return next(g for ranks, g in zip(enumeration, groups) if rt.rank in ranks)


def run_group(ranks: list[int] | None):
    """dist.new_group(ranks) (collective: every rank of the job calls it, in the same order), kept
    for this run alone: release_run_groups ends it with the run. A gloo group holds three threads
    and an NCCL one a communicator's device memory; a process that runs job after job in one group
    (a notebook, the tests' kept ranks) gathered them run after run (a kept rank idling after 12 of
    the tests' parity runs used 4x the CPU of a fresh one)."""
    group = dist.new_group(ranks)
    if group is not dist.GroupMember.NON_GROUP_MEMBER:
        _run_groups.append(group)
    return group


def release_run_groups() -> None:
    """Destroy the groups run_group made for the run that ends (each rank its own: not collective)."""
    while _run_groups:
        dist.destroy_process_group(_run_groups.pop())


def data_ranks(rt: Runtime) -> list[int]:
    """The global ranks of this rank's data-parallel group, in data-rank order."""
    if rt.data_view is None:
        return list(range(rt.world_size))
    return dist.get_process_group_ranks(rt.data.group) if rt.data.group is not None else [rt.rank]


def fsdp_mesh(rt: Runtime, plan: ParallelPlan):
    """FSDP2's mesh: `dp_shard`, or (`dp_replicate`, `dp_shard`) for HSDP (replicas reduce with each other).
    Context-parallel ranks shard too (`dp_shard` x `cp` flattened, torchtitan's `dp_shard_cp`): each
    holds part of every sequence, so their gradients are reduced together, and sharding over them costs
    no more traffic than reducing."""
    shard = _flat(rt.mesh, ("dp_shard", "cp"), "dp_shard_cp") if plan.cp > 1 else "dp_shard"
    return rt.mesh["dp_replicate", shard] if plan.dp_replicate > 1 else rt.mesh[shard]


def grad_group(rt: Runtime, plan: ParallelPlan):
    """The process group whose gradients DDP averages: the data-parallel ranks, with context
    parallelism also the context-parallel ones (`dp_replicate` x `dp_shard` x `cp` flattened)."""
    if plan.cp == 1:
        return rt.data.group
    return rt.mesh[_flat(rt.mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp")].get_group()


def _flat(mesh, dims: tuple[str, ...], name: str) -> str:
    """`name`, a dimension of the root mesh that flattens `dims` (made once per mesh: collective)."""
    try:
        mesh[name]
    except (KeyError, RuntimeError, ValueError):
        mesh[dims]._flatten(name)
    return name

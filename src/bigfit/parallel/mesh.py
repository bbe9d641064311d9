"""The named DeviceMesh of a plan, and the data-parallel view of this rank inside it.

The mesh has every dimension of the plan (`pp`, `dp_replicate`, `dp_shard`, `tp`, outermost first),
degree 1 included, so that code asks for a dimension by name whatever the layout: FSDP2 shards over
`dp_shard` (HSDP: `dp_replicate` x `dp_shard`), DTensor splits over `tp`, pipeline stages talk over
`pp`. Neighbouring ranks share the innermost dimension: tensor parallelism, the most talkative,
stays inside a node. One process without a process group has no mesh: its data view is itself.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..distributed import Runtime
from .plan import DIMS, ParallelPlan


_made: dict = {}  # (device type, degrees) -> (mesh, data view), for the process group they were made in


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
    pp, rep, shard, tp = mesh.get_coordinate()
    groups = [mesh.mesh[p, :, :, t].flatten().tolist() for p in range(plan.pp) for t in range(plan.tp)]
    group = dist.new_subgroups_by_enumeration(groups)[0] if plan.dp > 1 else None  # collective: every rank
    return Runtime(rank=rep * plan.dp_shard + shard, world_size=plan.dp, local_rank=rt.local_rank, device=rt.device,
                   group=group)


def fsdp_mesh(rt: Runtime, plan: ParallelPlan):
    """FSDP2's mesh: `dp_shard`, or (`dp_replicate`, `dp_shard`) for HSDP (replicas reduce with each other)."""
    return rt.mesh["dp_replicate", "dp_shard"] if plan.dp_replicate > 1 else rt.mesh["dp_shard"]

"""The global gradient norm of any layout, and clipping by it.

Each rank holds pieces of the gradients: whole tensors (replicas, pipeline stages), FSDP2 shards,
tensor-parallel slices, or 2-D DTensors of both. Summing every rank's squared local pieces over the
world counts each element once per copy of it, so each parameter's sum is divided by its number of
copies: the ranks of its pipeline position over the distinct pieces it is cut into. One all-reduce
gives the norm the single-process model computes. torch's clip_grad_norm_ handles one kind of
tensor at a time (it cannot mix DTensors and plain tensors in one foreach call), hence this.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def pieces(p: torch.Tensor) -> int:
    """Distinct pieces a parameter is cut into across its mesh (1 for a plain tensor)."""
    if not isinstance(p, DTensor):
        return 1
    mesh, n = p.device_mesh, 1
    for dim, placement in enumerate(p.placements):
        if not placement.is_replicate():
            n *= mesh.size(dim)
    return n


def global_norm(params: list, ranks_per_position: int, skip: set[int] = frozenset()) -> torch.Tensor:
    """sqrt(sum of every gradient element squared, counted once): `ranks_per_position` ranks hold
    each pipeline position (world / pp); parameters whose id is in `skip` are copies counted elsewhere."""
    settle(params)
    device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None or id(p) in skip:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        copies = ranks_per_position // pieces(p)
        total += g.double().square().sum() / copies
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.sqrt().float()


def settle(params: list) -> None:
    """Reduce, in place, gradients still Partial over a mesh: weights replicated over tensor-parallel
    ranks that saw different tokens or heads (sequence-parallel norms, per-head q/k norms) get each
    rank's share of their gradient, which DTensor sums only when asked. Their local pieces would
    otherwise enter the norm unsummed."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=p.placements)


def clip_by(params: list, max_norm: float, total: torch.Tensor) -> float:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) as torch's clipping does (in fp32);
    returns the norm. Nothing is scaled when `max_norm` <= 0 or the norm is not finite."""
    norm = total.item()
    if max_norm > 0 and math.isfinite(norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).item()
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm

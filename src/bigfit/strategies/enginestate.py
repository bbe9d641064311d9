"""The offload engine's states as the rest of bigfit sees them (mixed into OffloadEngine,
offload.py): checkpoints by parameter name, each rank's rows as a DTensor so they reshard and
consolidate like FSDP2's, and the device copies reloaded from restored masters."""
from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh

from .placement import rows_as_dtensor


class EngineStates:
    """Uses the engine's io, buckets, masters, inners, flush, _upload and _await."""

    def checkpoint_state(self, module: torch.nn.Module) -> dict:
        """By name: {"model": the fp32 master weights (and buffers), "optim": {"state": moments and
        step}}; each rank's rows as a DTensor when there are several ranks."""
        self.flush()
        mesh = None
        if self.io.world > 1:  # the host states' own device type; the data-parallel ranks' group
            mesh = DeviceMesh.from_group(self.io.up_group, "cpu", mesh=self.io.ranks)
        rows = functools.partial(rows_as_dtensor, mesh=mesh, rank=self.io.rank)
        masters, optim = {}, {}
        for b, master in zip(self.buckets, self.masters):
            st = self.inners[b.index].state[master]
            for s in b.slots:
                masters[id(s.param)] = rows(master, s)
                optim[s.name] = {"step": st["step"], **{k: rows(st[k], s) for k in ("exp_avg", "exp_avg_sq")}}
        model = {name: masters.get(id(t), t) for name, t in module.state_dict(keep_vars=True).items()}
        return {"model": model, "optim": {"state": optim}}

    @property
    def state(self) -> dict:
        return {m: st for inner in self.inners for m, st in inner.state.items()}

    @torch.no_grad()
    def reload_params(self) -> None:
        """After the host masters were loaded from a checkpoint: the device copies follow them."""
        self.flush()
        for b in self.buckets:
            self._upload(b)
        self._await(self.buckets)

"""The offload engine's states as the rest of bigfit sees them (mixed into OffloadEngine,
engine.py): checkpoints by parameter name, each rank's rows as a DTensor so they reshard and
consolidate like FSDP2's, and the device copies reloaded from restored masters.

The moments are saved in their format (statefmt.py): fp32 and bf16 ones under torch's names
(exp_avg, exp_avg_sq: any strategy loads them, DCP converting bf16), int8 ones as codes and block
scales (exp_avg_codes, exp_avg_scales, ...), which only this engine reads. A checkpoint whose
format differs from this run's, int8 on one side, is converted a bucket at a time (`loading`)."""
from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..engine.protocol import Loading
from . import statefmt
from .buckets import Bucket
from .placement import rows_as_dtensor, scale_rows_as_dtensor


class EngineStates:
    """Uses the engine's io, buckets, masters, inners, state_format, flush, _upload and _await."""

    def checkpoint_state(self, module: torch.nn.Module) -> dict:
        """By name: {"model": the fp32 master weights (and buffers), "optim": {"state": moments and
        step}}; each rank's rows as a DTensor when there are several ranks."""
        self.flush()
        masters, optim, rows = {}, {}, self._rows()
        for b, master in zip(self.buckets, self.masters):
            st = self.inners[b.index].state[master]
            for s in b.slots:
                masters[id(s.param)] = rows(master, s)
            optim.update(self._moments(b, st))
        model = {name: masters.get(id(t), t) for name, t in module.state_dict(keep_vars=True).items()}
        return {"model": model, "optim": {"state": optim}}

    def loading(self, module: torch.nn.Module, saved: Mapping) -> Loading:
        """What a checkpoint whose entries are `saved` (DCP's metadata by flattened key) loads into:
        this engine's states where the checkpoint's moments are in a form DCP reads into them (fp32,
        bf16), else, a bucket at a time, temporaries of the checkpoint's form, then converted."""
        state = self.checkpoint_state(module)
        pieces, formats = [], set()  # the formats found, converted by DCP or a piece
        for b, master in zip(self.buckets, self.masters):
            st = self.inners[b.index].state[master]
            theirs = _saved_format(b, saved)
            formats.add(theirs)
            if (theirs == "int8") == (self.state_format == "int8"):
                continue
            for s in b.slots:  # their moments come in the piece; the step counter stays in the state
                state["optim"]["state"][s.name] = {"step": st["step"]}
            temp = statefmt.allocate("int8" if theirs == "int8" else "fp32", b,
                                     lambda kind, n, dtype: torch.zeros(n, dtype=dtype))
            pieces.append(({"optim": {"state": self._moments(b, {"step": st["step"], **temp})}},
                           functools.partial(_convert, temp, st, b)))
        note = (f"optimizer states: the checkpoint's are {' and '.join(sorted(formats))}, this run keeps "
                f"{self.state_format}: converted" if formats - {self.state_format} else None)
        return Loading(state, pieces, note)

    @functools.cached_property
    def _states_mesh(self) -> DeviceMesh | None:
        """The data-parallel ranks' group over the host states' own device type (None: one rank)."""
        return DeviceMesh.from_group(self.io.up_group, "cpu", mesh=self.io.ranks) if self.io.world > 1 else None

    def _rows(self, scales: bool = False):
        return functools.partial(scale_rows_as_dtensor if scales else rows_as_dtensor, mesh=self._states_mesh,
                                 rank=self.io.rank)

    def _moments(self, b: Bucket, st: dict) -> dict:
        """{slot name: {"step", the moments by the names their format saves them under}}."""
        rows, out = self._rows(), {}
        if statefmt.format_of(st) != "int8":
            for s in b.slots:
                out[s.name] = {"step": st["step"], **{k: rows(st[k], s) for k in statefmt.MOMENTS}}
            return out
        scales = self._rows(scales=True)
        for s, seg in zip(b.slots, statefmt.segments(b)):
            out[s.name] = {"step": st["step"], **{f"{k}_codes": rows(st[k], s) for k in statefmt.MOMENTS},
                           **{f"{k}_scales": scales(st[f"{k}_scale"], s, seg) for k in statefmt.MOMENTS}}
        return out

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


def _saved_format(b: Bucket, saved: Mapping) -> str:
    """The format a checkpoint holds a bucket's moments in: int8 (codes and scales), bf16 or fp32 (DCP
    reads either into the other, converting)."""
    key = f"optim.state.{b.slots[0].name}.exp_avg"
    if f"{key}_codes" in saved:
        return "int8"
    return "bf16" if key in saved and saved[key].properties.dtype == torch.bfloat16 else "fp32"


@torch.no_grad()
def _convert(temp: dict, st: dict, b: Bucket) -> None:
    statefmt.from_fp32(*statefmt.to_fp32(temp, b), st, b)

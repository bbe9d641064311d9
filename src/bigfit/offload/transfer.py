"""How the offload engine's bytes move. On a GPU: pinned host buffers, one CUDA stream down (reduce-
scatter, norm, device-to-host copy) and one up (host-to-device copy, cast, all-gather), ordered with
CUDA events, never with host waits on the training thread. On the CPU (the tests' gloo ranks) the
same calls run in order on the calling thread. Collectives use two groups of their own: the backward
hooks use one, the host thread the other, so each group's operations come in the same order on every
rank whatever the threads' timing. Those are groups of the data-parallel ranks (layout/mesh.py):
the whole job, or the ranks of one pipeline position; the gradient norm sums over every rank."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..common import faults
from ..layout.mesh import data_ranks, new_data_group
from .pinned import host_zeros


class Transfers:
    def __init__(self, rt):
        self.device, self.world, self.rank = rt.device, rt.data.world_size, rt.data.rank
        self.ranks = data_ranks(rt)  # global ranks of the data-parallel group
        self.cuda = rt.device.type == "cuda"
        self.down_group, self.up_group = new_data_group(rt), new_data_group(rt)
        self.down = torch.cuda.Stream(self.device) if self.cuda else None
        self.up = torch.cuda.Stream(self.device) if self.cuda else None
        self.back = torch.cuda.Stream(self.device) if self.cuda else None  # gradient slots (gradslots.py)
        self.squared = None  # the down stream's event after the latest bucket's squared norm

    # -- memory -----------------------------------------------------------------------------------
    def host_zeros(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return host_zeros(n, dtype, pin=self.cuda)  # exactly sized (pinned.py)

    def device_zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def whole(self, p: torch.Tensor) -> torch.Tensor:
        """The whole parameter in fp32 on this rank's device, with the first data-parallel rank's
        values: rank 0's, or those its pipeline stage received (pipeline/strategy.py)."""
        full = torch.empty(p.shape, dtype=torch.float32, device=self.device) if p.is_meta else \
            p.detach().to(self.device, torch.float32)
        if self.world > 1:
            dist.broadcast(full, src=self.ranks[0], group=self.down_group)
        return full

    @torch.no_grad()
    def place_buffers(self, model: torch.nn.Module) -> None:
        """Buffers (rotary tables, ...) to the device, the first data-parallel rank's values on every one."""
        for mod in model.modules():
            for name, buf in list(mod._buffers.items()):
                if buf is None:
                    continue
                t = torch.empty_like(buf, device=self.device) if buf.is_meta else buf.to(self.device)
                if self.world > 1:
                    dist.broadcast(t, src=self.ranks[0], group=self.down_group)
                mod._buffers[name] = t

    # -- down: backward hooks ---------------------------------------------------------------------
    def _on(self, stream):
        if not self.cuda:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    @torch.no_grad()
    def reduce_to_host(self, flat: torch.Tensor, host: torch.Tensor | None, state: dict,
                       dtype: torch.dtype = torch.float32, skip: list[tuple[int, int]] = ()) -> None:
        """(world, S) fp32 gradients -> this rank's averaged S values, cast to `dtype` on the device,
        in `host`; their squared norm (of the fp32 values) into state["sq"], the copy's completion
        into state["landed"]; the (start, length) spans in `skip` are left out of the norm (copies
        counted on another rank). `host` None: the values stay on the device as state["dev_grad"]
        (gradslots.py), "landed" marking their reduction."""
        faults.at("reduce")
        with self._on(self.down):
            if self.world > 1:
                out = torch.empty(flat.shape[1], dtype=flat.dtype, device=self.device)
                dist.reduce_scatter_tensor(out, flat.view(-1), group=self.down_group)
                out.div_(self.world)
            else:
                out = flat[0]
            state["sq"] = out.pow(2).sum() - sum(out[a:a + n].pow(2).sum() for a, n in skip)
            if self.cuda:  # the step's norm waits for this, not for the copy queued behind it (`total`)
                self.squared = torch.cuda.Event()
                self.squared.record(self.down)
            out = out.to(dtype)  # bf16 (kernels/cpu_adam.py reads it): half the bytes down and in host RAM
            if host is None:
                state["dev_grad"] = out  # fp32 with one rank: a view of `flat`, which nothing else uses
            else:
                host.copy_(out, non_blocking=True)
            if self.cuda:
                flat.record_stream(self.down)  # allocated on the training stream, used on this one
                state["landed"] = torch.cuda.Event()
                state["landed"].record(self.down)

    def total(self, squares: list[torch.Tensor]) -> float:
        """The global sum of the buckets' squared norms: the step's one host sync. It waits for the
        last bucket's square (and so, in stream order, every earlier one), not for that bucket's copy
        down: the host step starts with buckets that landed long ago (engine.py) and waits for the
        copy itself only when it reaches that bucket."""
        if self.cuda and self.squared is not None:
            torch.cuda.current_stream().wait_event(self.squared)
        s = torch.stack(squares).sum()
        if dist.is_initialized() and dist.get_world_size() > 1:  # every stage's (pipelines), not only ours
            dist.all_reduce(s)
        return float(s)

    # -- the host thread --------------------------------------------------------------------------
    @torch.no_grad()
    def fetch(self, state: dict, slot: torch.Tensor) -> torch.Tensor:
        """A bucket's device gradients (state["dev_grad"]) into the front of a pinned slot, on a
        stream of their own; the copy's completion becomes state["fetched"]."""
        faults.at("fetch")
        grad = state.pop("dev_grad")
        view = slot[:grad.numel()]
        if not self.cuda:
            view.copy_(grad)
            return view
        with torch.cuda.stream(self.back):
            self.back.wait_event(state["landed"])
            view.copy_(grad, non_blocking=True)
            grad.record_stream(self.back)  # made on the down stream, freed once this copy is done
            state["fetched"] = torch.cuda.Event()
            state["fetched"].record(self.back)
        return view

    def enter_thread(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)

    def wait_landed(self, state: dict) -> None:
        """Before the host reads a bucket's gradients and writes its masters: the gradients are in,
        and the previous upload has finished reading the masters."""
        for key in ("landed", "fetched", "arrived"):
            if self.cuda and state.get(key) is not None:
                state[key].synchronize()

    @contextlib.contextmanager
    def uploading(self, state: dict):
        """Device work inside runs on the upload stream; its completion becomes state["arrived"]. It
        does not wait for the training stream (which may already be queueing the next forward): the
        host thread made sure the bucket's last readers are done (`wait_landed`)."""
        with torch.cuda.stream(self.up) if self.cuda else contextlib.nullcontext():
            yield
            if self.cuda:
                state["arrived"] = torch.cuda.Event()
                state["arrived"].record(self.up)

    def gather(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's updated fp32 values up, cast, and all-gathered: (world, S) in `dtype`."""
        faults.at("gather")
        local = master.to(self.device, non_blocking=True).to(dtype)
        if self.world == 1:
            return local.view(1, -1)
        out = torch.empty(self.world * local.numel(), dtype=dtype, device=self.device)
        dist.all_gather_into_tensor(out, local, group=self.up_group)
        return out.view(self.world, -1)

    def wait_arrived(self, state: dict) -> None:
        """The training stream waits (on the device) for the bucket's upload."""
        if self.cuda and state.get("arrived") is not None:
            torch.cuda.current_stream().wait_event(state["arrived"])

    def after_current_work(self) -> None:
        """Uploads issued next start after the device's work so far (which reads the parameters)."""
        if self.cuda:
            self.up.wait_stream(torch.cuda.current_stream())

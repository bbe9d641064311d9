"""zero2-offload's engine (DeepSpeed's ZeRO-Offload, streamed): parameters in the compute dtype on
the device, fp32 master weights, Adam's moments and the optimizer step in host RAM (or NVMe files).

One step, per bucket (buckets.py: a block, or a run of non-block parameters):
1. backward: when the last gradient of a bucket is accumulated, a hook packs the bucket's gradients
   into one fp32 buffer and, on a side stream, reduce-scatters it (each rank keeps its rows), adds
   its squared norm to the step's sum and copies it into a pinned host buffer. The copies of early
   buckets run while the device computes the gradients of the next ones.
2. `clip_and_step`: one sync for the global gradient norm; a host thread (hoststep.py) then steps
   the buckets in forward order with a fused CPU Adam (kernels/cpu_adam.py: multi-threaded, GIL released),
   which also unscales (fp16) and clips: it divides each gradient by `grad_scale`, so no pass over the
   gradients is spent on either. After each bucket it copies the master weights up, casts them on the device and
   all-gathers them (side stream, CUDA events).
3. the next forward: each block waits, on the device, for its own bucket's event only, so it
   starts while the host still updates the blocks behind it.
Without clipping and loss scaling (`eager=True`) no global norm is needed first: the host thread
starts at the first bucket of backward and steps each bucket as it lands, under the rest of backward.
Where gradients wait for the host step (`grads_on_device`, config `offload_grads`): in pinned host
buffers of their own, copied down during backward (the default), or on the device, copied down
through a few pinned slots just ahead of the host step (gradslots.py): 12 bytes of host RAM per
parameter instead of 14 (16 with fp32 gradients), for the largest models. Gradients travel in bf16
when the compute dtype is bf16 and bigfit's kernel does the host step (kernels/cpu_adam.py), the reduce and
the norm still in fp32 on the device. The NVMe tier keeps the first buckets' states in
host RAM up to `nvme_host_bytes` and the rest in files (nvme.py).
Collectives of the backward hooks and of the host thread use two process groups of their own, so
each group sees the same order of operations on every rank.

Delayed update (`delayed=True`, DeepSpeed's "delayed parameter update"): the host step of step t
runs while the device computes step t+1, and each bucket's result is copied up as soon as both are
done with it: the host step has updated the bucket and step t+1's backward has finished its
gradients (the bucket's hook: the device no longer reads those parameters in step t+1). So the
forward and backward of step t use the parameters after update t-2 (the
initial ones for steps 1 and 2): one update staler than without delay; gradients are applied to
the latest master weights as usual. `flush()` lands any pending update (before evaluation,
checkpoints and the end of training); tests/test_training_features.py checks the exact lag.
"""
from __future__ import annotations

import atexit
import functools
import math
import threading
import weakref

import torch

from ..common import waits
from ..engine.protocol import grad_hook, syncing
from ..kernels import cpu_adam
from ..models.source import block_lists, owners
from . import statefmt
from .buckets import Bucket, group_parameters, local_span, make_buckets, pack
from .enginestate import EngineStates
from .gradslots import GradientSlots
from .hoststep import HostSteps, join_at_exit
from .nvme import NVMeStore
from .placement import materialise, place_frozen, waiting_modules
from .transfer import Transfers


RECOVERY_S = 120.0  # abandon_step's wait for a host step to end: longer than any one bucket's step and copies


class OffloadEngine(HostSteps, EngineStates):
    """Built when the strategy is applied (it places the model); the optimizer once `attach`ed."""

    def __init__(self, model: torch.nn.Module, rt, compute: torch.dtype | None, *, delayed: bool = False,
                 eager: bool = False, nvme_dir=None, nvme_host_bytes: float = 0, grads_on_device: bool = False,
                 bucket_numel: int = 32 << 20, held: frozenset = frozenset(), uncounted: frozenset = frozenset(),
                 weights=None, state_format: str = "fp32"):
        """`held`: ids of parameters whose gradients stay on them until `land` (a pipeline sums tied
        copies first); `uncounted`: ids of those whose norm another rank counts (the other copies);
        `weights`: the parameters' and buffers' values made on this rank (loading.WholeParams), else
        the first data-parallel rank's, broadcast (`Transfers`); `state_format`: the moments' format
        in host RAM or files (statefmt.py)."""
        self.rt, self.delayed, self.eager, self.held = rt, delayed, eager and not delayed, held
        self.dtype = compute or torch.float32
        # a pipeline stage's block lists hold only its blocks, under their own indices
        prefixes = [f"{name}.{i}" for name, blocks in block_lists(model) for i, _ in blocks.named_children()]
        self.buckets = make_buckets(group_parameters(model, prefixes, bucket_numel), rt.data.world_size)
        self.io = Transfers(rt)
        sizes = [b.numel for b in self.buckets]
        self.state_format = state_format
        self.store = NVMeStore(nvme_dir, sizes, nvme_host_bytes, statefmt.bytes_per_parameter(state_format)) \
            if nvme_dir else None
        holders, source = owners(model), weights or self.io
        self.masters = [materialise(b, self._new_master(b), source, self.io.rank, self.dtype, holders)
                        for b in self.buckets]
        place_frozen(model, source, self.dtype, holders)
        source.place_buffers(model)
        self.grads_on_device, self.slots, self.grad_buffers = grads_on_device, None, None  # made by `attach`
        self.kernel, self.grad_dtype = False, torch.float32
        for b in self.buckets:
            b.state.update(ready=0, acc=None, sq=None, free=threading.Event(), issued=threading.Event(),
                           reduced=threading.Event(), stepped=threading.Event(), stale=False,
                           hooked=sum(id(s.param) not in self.held for s in b.slots),
                           uncounted=[local_span(s, self.io.rank) for s in b.slots if id(s.param) in uncounted])
            b.state["free"].set()
            b.state["issued"].set()
        self._of = {id(s.param): b for b in self.buckets for s in b.slots}
        self._hooks = [s.param.register_post_accumulate_grad_hook(grad_hook(self._on_grad))
                       for b in self.buckets for s in b.slots if id(s.param) not in self.held]
        self._hooks += [m.register_forward_pre_hook(functools.partial(self._await_hook, bs))
                        for m, bs in waiting_modules(model, prefixes, self._of)]
        self.sync, self._worker, self._error, self._eager_started = True, None, None, False
        self._stopping, self._phase = False, "its start"  # hoststep.py: an abandoned step; where the thread is
        # a daemon host thread still inside torch when the interpreter exits aborts the process
        # ("terminate called without an active exception"): a process that ends without flush() waits
        atexit.register(join_at_exit, weakref.ref(self))
        self.trace: list | None = None  # set to [] to record (what, bucket, start, end) host times: benchmarks
        self.param_groups, self.inners = [{}], []

    # -- building ---------------------------------------------------------------------------------
    def _new_master(self, b: Bucket) -> torch.Tensor:
        return self.store.tensor(b.index, "master", b.numel, torch.float32) if self._on_disk(b) else \
            self.io.host_zeros(b.numel)

    def _on_disk(self, b: Bucket) -> bool:
        return self.store is not None and b.index in self.store.files

    def attach(self, cls, **kw) -> "OffloadEngine":
        """One torch optimizer per bucket over its flat master (fused kernels: one call per bucket);
        the states exist from the start, in their format (statefmt.py), as views that checkpoints and
        the NVMe files share. With bigfit's own kernel (kernels/cpu_adam.py) and bf16 compute, gradients travel
        and wait in bf16."""
        for b, master in zip(self.buckets, self.masters):
            inner = cls([master], **kw)
            zeros = functools.partial(self.store.tensor, b.index) if self._on_disk(b) else \
                lambda kind, n, dtype: torch.zeros(n, dtype=dtype)  # never copied: no need to pin them
            inner.state[master] = {"step": torch.tensor(0.0), **statefmt.allocate(self.state_format, b, zeros)}
            self.inners.append(inner)
        self.param_groups = [{k: v for k, v in self.inners[0].param_groups[0].items() if k != "params"}]
        self.kernel = bool(self.inners) and cpu_adam.supports(self.inners[0])
        self.grad_dtype = torch.bfloat16 if self.kernel and self.dtype == torch.bfloat16 else torch.float32
        sizes = [b.numel for b in self.buckets]
        if self.grads_on_device:
            self.slots = GradientSlots(self.io, sizes, self.grad_dtype)
        else:
            self.grad_buffers = [self.io.host_zeros(n, self.grad_dtype) for n in sizes]
        return self

    # -- backward: gradients stream down as buckets complete --------------------------------------
    def syncing(self, sync: bool):
        """Accumulation micro-batches (sync False) add their gradients to a device buffer instead."""
        return syncing(self, sync)

    def _on_grad(self, p: torch.Tensor) -> None:
        b = self._of[id(p)]
        b.state["ready"] += 1
        if b.state["ready"] == b.state["hooked"]:
            self._reduce(b, final=self.sync)

    @torch.no_grad()
    def _reduce(self, b: Bucket, final: bool = True) -> None:
        """The bucket's gradients into its (world, S) buffer; `final`: reduced and sent down."""
        st = b.state
        st["ready"] = 0
        flat = st["acc"] if st["acc"] is not None else self.io.device_zeros(self.io.world, b.numel)
        for s in b.slots:
            if s.param.grad is not None and (final or id(s.param) not in self.held):
                pack(flat, s, s.param.grad, accumulate=st["acc"] is not None)
                s.param.grad = None
        if not final:
            st["acc"] = flat
            return
        st["acc"] = None
        # the host step of the previous update has read this bucket's host gradients
        waits.wait(st["free"], f"the host step to read the gradients of {self._named(b)} of the step before")
        st["free"].clear()
        if st["stale"]:  # delayed: this backward is done with the parameters; the previous update goes up
            self._upload_stale([b])
        self.io.reduce_to_host(flat, self.grad_buffers[b.index] if self.grad_buffers else None, st, self.grad_dtype,
                               skip=st["uncounted"])
        st["reduced"].set()
        if self.eager and not self._eager_started:  # no global norm to wait for: step buckets as they land
            self._eager_started = True
            self._start_host_step(1.0, list(reversed(self.buckets)), upload=True)

    def land(self) -> None:
        """After a micro-batch whose backward passes all accumulated (a pipeline schedule's chunks):
        every bucket's gradients, the held ones' included, reduced and sent down, last block first."""
        for b in reversed(self.buckets):
            self._reduce(b)

    def _drain(self) -> None:
        """Buckets with parameters that got no gradient this step: their missing gradients are zeros."""
        for b in self.buckets:
            if b.state["sq"] is None:
                self._reduce(b)

    # -- the step ---------------------------------------------------------------------------------
    def clip_and_step(self, max_norm: float, loss_scale: float = 1.0) -> float:
        """After the step's last backward: the global gradient norm (unscaled) and the host step
        started. An infinite norm (an fp16 overflow) skips the step."""
        if self.eager and (max_norm > 0 or loss_scale != 1.0):
            raise RuntimeError("this offload engine steps during backward: it cannot clip or unscale")
        if not self.eager:
            with self._span("wait-host-step"):
                self._join()
        self._drain()
        with self._span("norm"):
            sq = self.io.total([b.state["sq"] for b in self.buckets])
        for b in self.buckets:
            b.state["sq"] = None
        norm = math.sqrt(sq) / loss_scale
        if self.eager:
            self._eager_started = False  # the next backward starts the next host step
            return norm
        if not math.isfinite(norm):
            for b in self.buckets:
                b.state["free"].set()
                b.state["reduced"].clear()
            return norm
        clip = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        if self.delayed:
            self._upload_pending()
            self._start_host_step(loss_scale / clip, list(reversed(self.buckets)), upload=False)  # landing order
        else:
            self._start_host_step(loss_scale / clip, self.buckets, upload=True)
        return norm

    def _await_hook(self, buckets, module, args) -> None:
        self._await(buckets)

    def _await(self, buckets) -> None:
        for b in buckets:
            if not b.state["issued"].is_set():
                with self._span("forward-waits", b):
                    waits.wait(b.state["issued"], lambda b=b: f"the host step's update of {self._named(b)} (it is "
                                                              f"at {self._phase})")
            self._raise()
            self.io.wait_arrived(b.state)

    def abandon_step(self) -> None:
        """After a step that failed (an out-of-memory error in its forward, backward, host step or copies:
        micro-batch auto's probe, at lr 0): the host step under way ended first, then the gradients the
        step left in buckets dropped and every bucket free again. A host step still stepping buckets
        (its thread runs on under the next forward) clearing gradients under it waited forever for
        them, and the process's exit with it (tests/test_training_probe.py; the likely cause of a probe
        that never exited, gpt-neo-1.3B's shape on a 16 GB cap); one
        that waits for buckets a failed backward never sent (eager mode steps during backward) stops
        there. Buckets it already stepped stay stepped. A RuntimeError where it does not end within RECOVERY_S (or
        BIGFIT_WAIT_S): the engine cannot go on, the probe then does in new processes."""
        self._stopping = True
        for b in self.buckets:
            b.state["reduced"].set()  # wakes a host step waiting for gradients: it stops (`_landing`)
        try:
            self._join(waits.limit(RECOVERY_S))
        except RuntimeError:
            if self._worker is not None:  # still under way: not an error it met, which is dropped with its step
                raise
        finally:
            self._stopping = False
        if self.io.cuda:
            with waits.waiting("the device to finish the copies the failed step queued"):
                torch.cuda.synchronize()
        for b in self.buckets:
            b.state.update(ready=0, acc=None, sq=None, dev_grad=None)
            b.state["reduced"].clear()
            b.state["free"].set()
            for s in b.slots:
                s.param.grad = None
        if self.slots:
            self.slots.reset()
        self._eager_started = False

    def flush(self) -> None:
        """Land every update on the device: before evaluation, checkpoints and the end."""
        self._join()
        if self.delayed:
            self._upload_pending()
        self._await(self.buckets)

    def remove(self) -> None:
        """Take the hooks off (the model keeps its device parameters)."""
        self.flush()
        for h in self._hooks:
            h.remove()
        self._hooks = []

"""ZeRO-Offload's optimizer half: fp32 master weights, optimizer states and the optimizer step in
host RAM, parameters on the device.

After backward, each rank's gradient shards are copied to host buffers, a torch optimizer (AdamW /
Adam, torch's fused CPU kernel) updates the host master weights, and the results are copied back
into the device shards. The fast path (streaming per bucket during backward, overlapped with
compute) is the offload engine's job.

Delayed update (`delayed=True`, DeepSpeed's "delayed parameter update"): the host step of step t runs
in a thread while the device computes step t+1, and its result reaches the device at the start of
step t+1's optimizer call. So the forward and backward of step t use the parameters after update
t-2 (the initial ones for steps 1 and 2): parameters one update staler than without delay, gradients
applied to the latest master weights as usual. `flush()` lands the pending update (before evaluation,
checkpoints and the end of training); tests/test_training_features.py checks the exact lag.
"""
from __future__ import annotations

import threading

import torch

from .base import local
from .nvme import NVMeStore


class HostOffloadOptimizer:
    """`nvme_dir`: master weights and moments in files there (zero2-offload-nvme, see nvme.py)."""

    def __init__(self, named_params, cls, delayed: bool = False, nvme_dir=None, **kw):
        self.names, self.params = zip(*[(n, p) for n, p in named_params if p.requires_grad])
        pin = any(local(p).is_cuda for p in self.params)
        self.store = NVMeStore(nvme_dir, [local(p).numel() for p in self.params]) if nvme_dir else None
        self.masters = [self._master(i, p, pin) for i, p in enumerate(self.params)]
        for m in self.masters:
            m.grad = torch.zeros_like(m, pin_memory=pin)
        buckets = self.store.buckets if self.store else [list(range(len(self.params)))]
        self.inners = [cls([self.masters[i] for i in b], **kw) for b in buckets]
        if self.store:  # the moments live in the files: give the optimizer its states up front
            for i, m in enumerate(self.masters):
                inner = self.inners[next(k for k, b in enumerate(buckets) if i in b)]
                inner.state[m] = {"step": torch.tensor(0.0), **{k: self.store.views[k][i].view_as(m)
                                                               for k in ("exp_avg", "exp_avg_sq")}}
        # the loop sets the learning rate here; copied into the host optimizer when a step starts, so
        # a delayed step still running never sees the next step's value
        self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.inners[0].param_groups]
        self.delayed = delayed
        self._pending: threading.Thread | None = None

    def _master(self, i: int, p, pin: bool) -> torch.Tensor:
        if self.store:
            return self.store.views["master"][i].view(local(p).shape).copy_(local(p).detach())
        m = local(p).detach().to("cpu", torch.float32, copy=True)
        return m.pin_memory() if pin else m

    @property
    def state(self) -> dict:
        return {m: st for inner in self.inners for m, st in inner.state.items()}

    @torch.no_grad()
    def step(self) -> None:
        self.flush()
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                m.grad.copy_(local(p.grad), non_blocking=True)
        if any(local(p).is_cuda for p in self.params[:1]):
            torch.cuda.current_stream().synchronize()  # host buffers complete before the CPU step
        for inner in self.inners:
            for group in inner.param_groups:
                group.update(self.param_groups[0])
        if self.delayed:  # torch's kernels release the GIL: the step runs beside the next forward
            self._pending = threading.Thread(target=self._host_step, daemon=True)
            self._pending.start()
        else:
            self._host_step()
            self._to_device()

    @torch.no_grad()
    def _host_step(self) -> None:
        for k, inner in enumerate(self.inners):
            if self.store:
                self.store.prefetch(k + 1)  # the disk reads bucket k+1 while bucket k updates
            inner.step()

    @torch.no_grad()
    def _to_device(self) -> None:
        for p, m in zip(self.params, self.masters):
            local(p).copy_(m, non_blocking=True)

    def flush(self) -> None:
        """Land a delayed update on the device (a no-op without delay or with none pending)."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
            self._to_device()

    @torch.no_grad()
    def reload_masters(self) -> None:
        """After the device parameters were loaded from a checkpoint."""
        for p, m in zip(self.params, self.masters):
            m.copy_(local(p))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def owned(self):
        """(device parameter, host state) pairs: every state here belongs to this rank's shards."""
        state = self.state
        return [(p, state[m]) for p, m in zip(self.params, self.masters)]

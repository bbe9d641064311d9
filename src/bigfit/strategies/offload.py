"""ZeRO-Offload's optimizer half: fp32 master weights, optimizer states and the optimizer step in
host RAM, parameters on the device.

After backward, each rank's gradient shards are copied to host buffers, a torch optimizer (AdamW /
Adam, multi-tensor) updates the host master weights, and the results are copied back into the
device shards. This version is correct and honest about memory; the fast path (streaming per bucket
during backward, overlapped with compute) is the offload engine's job.
"""
from __future__ import annotations

import torch

from .base import local


class HostOffloadOptimizer:
    def __init__(self, named_params, cls, **kw):
        self.names, self.params = zip(*[(n, p) for n, p in named_params if p.requires_grad])
        pin = any(local(p).is_cuda for p in self.params)
        self.masters = [local(p).detach().to("cpu", torch.float32, copy=True) for p in self.params]
        if pin:
            self.masters = [m.pin_memory() for m in self.masters]
        for m in self.masters:
            m.grad = torch.zeros_like(m, pin_memory=pin)
        self.inner = cls(self.masters, **kw)
        self.param_groups = self.inner.param_groups  # the loop sets the learning rate here
        self.state = self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                m.grad.copy_(local(p.grad), non_blocking=True)
        if any(local(p).is_cuda for p in self.params[:1]):
            torch.cuda.current_stream().synchronize()  # host buffers complete before the CPU step
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            local(p).copy_(m, non_blocking=True)

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
        return [(p, self.inner.state[m]) for p, m in zip(self.params, self.masters)]

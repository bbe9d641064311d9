"""One parameter's host side for OffloadAdamW (offload_adamw.py): its fp32 master weights, Adam's two
moments in a format of offload/statefmt.py (host RAM, or files: offload/nvme.py), and the host slot its
gradient lands in as backward makes it.

A gradient's life. Backward accumulates it into `param.grad`; the post-accumulate-grad hook hands it to
`take`, which copies it into the slot (on a CUDA device: asynchronously, on a side stream, into pinned
memory) and drops `param.grad`, so the device holds no gradient past its own backward. A second
backward before the step (gradient accumulation) sums into the slot: on the host, after its copy has
landed into a staging buffer (the device's copy of the first is in flight, and adding on the device
would need the gradient kept there). `held` counts the backward passes summed: None is torch's
`grad is None` (the step skips the parameter, as torch's does), 0 is `zeros` (zero_grad(set_to_none=
False) after a gradient: stepped with a zero gradient, as torch's would be), and STEPPED a gradient
the step has consumed (torch's would still hold it: a step skips it, a backward overwrites it, and
zero_grad(set_to_none=False) makes it zeros).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch.optim.adam import adam

from ..kernels import cpu_adam
from ..offload import statefmt
from ..offload.buckets import Bucket, make_buckets
from ..offload.pinned import host_zeros


STEPPED = -1  # `held` of a gradient the step consumed


class HostParam:
    """`index`: the parameter's number among the optimizer's (bf16's stochastic rounding draws other bits
    for each); `zeros(kind, numel, dtype)`: where the master and moments live; `pin`: page-locked slot and
    master (the parameter is on a CUDA device); `kernel`: bigfit's kernel steps it (else torch's code)."""

    def __init__(self, param: torch.Tensor, index: int, fmt: str, zeros: Callable, pin: bool, kernel: bool,
                 lock: threading.Lock):
        self.param, self.pin, self.kernel, self.lock = param, pin, kernel, lock
        self.bucket: Bucket = make_buckets([[("param", param)]], 1)[0]  # statefmt's layout: rows, int8 blocks
        self.bucket.index = index
        n = param.numel()
        self.master = zeros("master", n, torch.float32)
        self.master.copy_(param.detach().reshape(-1))
        self.state = {"step": torch.tensor(0.0), **statefmt.allocate(fmt, self.bucket, zeros)}
        # bf16 gradients travel and wait in bf16 where the kernel reads them (2 bytes a parameter, not 4)
        self.grad_dtype = torch.bfloat16 if kernel and param.dtype == torch.bfloat16 else torch.float32
        self.grad = host_zeros(n, self.grad_dtype, pin)
        self.staging: torch.Tensor | None = None  # an accumulated gradient's copy, until added into `grad`
        self.staged, self.event = False, None  # the last copy's CUDA event
        self.held: int | None = None
        self.after: int | None = STEPPED  # what `held` becomes once the host step has read the slot
        self.free = threading.Event()  # not in a host step: the slot may be written
        self.free.set()

    # -- gradients ----------------------------------------------------------------------------------
    @torch.no_grad()
    def take(self, g: torch.Tensor, stream) -> None:
        """Backward's gradient into the slot (summed with those held); the caller drops param.grad."""
        self.free.wait()  # delayed mode: the host step of the update before has read this slot
        flat = g.reshape(-1)
        add = self.held is not None and self.held > 0
        if g.device.type != "cuda":
            self.grad.add_(flat) if add else self.grad.copy_(flat)
        else:
            self._fold()
            if add and self.staging is None:
                self.staging = host_zeros(self.grad.numel(), self.grad_dtype, self.pin)
            dst = self.staging if add else self.grad
            stream.wait_stream(torch.cuda.current_stream(g.device))  # the gradient is made
            with torch.cuda.stream(stream):
                dst.copy_(flat, non_blocking=True)
                self.event = stream.record_event()
            g.record_stream(stream)  # its memory is not reused before the copy has read it
            flat.record_stream(stream)  # reshape's copy, where the gradient was not contiguous
            self.staged = add
        self.held = (self.held if add else 0) + 1

    def _fold(self) -> None:
        """The copies landed; an accumulated gradient's added into the slot."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        if self.staged:
            self.grad.add_(self.staging)
            self.staged = False

    def landed(self) -> torch.Tensor | None:
        """The summed gradient in host RAM (waits for the copies), or None where there is none."""
        self._fold()
        if self.held == 0:
            self.grad.zero_()
        return None if self.held in (None, STEPPED) else self.grad

    def clear(self, set_to_none: bool) -> None:
        """zero_grad: a slot the host step still reads is cleared once it has (`after`)."""
        with self.lock:
            if not self.free.is_set():  # the host step has it: a gradient, as torch sees it
                self.after = None if set_to_none else 0
                return
        self._fold()
        self.held = None if set_to_none or self.held is None else 0

    def sq_norm(self) -> float:
        g = self.landed()
        return 0.0 if g is None else float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2

    # -- the step -----------------------------------------------------------------------------------
    def begin(self) -> None:
        """Handed to a host step: backward must not write the slot until `step` has read it."""
        self.free.clear()
        self.after = STEPPED

    @torch.no_grad()
    def step(self, group: dict, grad_scale: float) -> None:
        """Adam on the master and moments with the slot's gradient divided by `grad_scale` (clipping), with
        `group`'s lr, betas, eps, weight_decay; the gradient is consumed (`held` becomes `after`)."""
        try:
            grad = self.grad  # `landed` was called by the optimizer before the host step
            inner = SimpleNamespace(param_groups=[group], state={self.master: self.state})  # what cpu_adam reads
            if statefmt.format_of(self.state) != "fp32":  # the kernel, else its plain-torch reference
                statefmt.step(inner, self.master, grad, grad_scale, self.bucket, 0, self.kernel)
            elif self.kernel:
                cpu_adam.step(inner, self.master, grad, grad_scale)
            else:
                self._torch_step(group, grad, grad_scale)
        finally:
            with self.lock:
                self.held, self.after = self.after, STEPPED
                self.free.set()

    def _torch_step(self, group: dict, grad: torch.Tensor, grad_scale: float) -> None:
        """No C compiler built the kernel: torch's fused CPU AdamW (fp32 gradients), which unscales in place."""
        beta1, beta2 = group["betas"]
        adam([self.master], [grad], [self.state["exp_avg"]], [self.state["exp_avg_sq"]], [], [self.state["step"]],
             fused=True, grad_scale=torch.tensor(grad_scale), decoupled_weight_decay=True, amsgrad=False, beta1=beta1,
             beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    @torch.no_grad()
    def upload(self) -> None:
        """The master into the parameter, cast to its dtype: asynchronous from pinned memory to a GPU, cast
        there (torch casts a host tensor on the host first, into pageable memory, which copies synchronously)."""
        src = self.master.view(self.param.shape)
        if self.pin and self.param.dtype != src.dtype:
            src = src.to(self.param.device, non_blocking=True)
        self.param.copy_(src, non_blocking=self.pin)

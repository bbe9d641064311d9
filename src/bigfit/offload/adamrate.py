"""The host Adam step's speed on this machine (`bigfit plan --calibrate`, benchmarks/host_adam.py), in
parameters a second: torch's fused AdamW with fp32 gradients (the unit of hardware.cpu_adam_params_per_s,
which the planner rates zero3-offload's and device maps' host steps by) and bigfit's kernel in each
optimizer-state format with bf16 gradients, as the offload engine steps under bf16 compute.

Measured because the bytes a parameter moves do not rate the compact formats on every host: on the
CPU machine's 2 cores the int8 kernel computes rather than waits for memory (0.58-0.66 of the fp32
kernel's rate where its bytes say 1.6x), and a 16-core host may be memory-bound. Each format steps one
bucket of Llama-like rows (ROW a row) through the engine's own calls (offload/statefmt.step,
cpu_adam.step), untimed steps first, then the median; the working set (about 14 bytes a parameter)
is far past a host's caches at the calibration's size."""
from __future__ import annotations

import statistics
import time

import torch

from ..kernels import cpu_adam
from . import statefmt
from .buckets import make_buckets

ROW = 4096
CALIBRATION_PARAMS = 1 << 25  # 32M parameters: ~0.5 GB, a few seconds on 2 cores
KERNEL_FORMATS = statefmt.FORMATS


def bucket(params: int):
    """One bucket of rows of ROW parameters (at least one row), laid out as the offload engine lays them."""
    rows = max(1, params // ROW)
    return make_buckets([[("w", torch.nn.Parameter(torch.empty(rows, ROW, device="meta")))]], 1)[0]


def step_seconds(fmt: str, params: int, repeats: int = 5, warmup: int = 2) -> tuple[int, float]:
    """(parameters stepped, the median seconds of a step) of `fmt`: "torch" (fused AdamW, fp32 gradients)
    or one of KERNEL_FORMATS (bigfit's kernel, bf16 gradients)."""
    b = bucket(params)
    master = torch.randn(b.numel)
    grad = (torch.randn(b.numel) * 1e-3).to(torch.bfloat16)
    inner = torch.optim.AdamW([master], lr=1e-4, weight_decay=0.01, fused=fmt == "torch")
    if fmt == "torch":
        master.grad = grad.float()
        step = inner.step
    else:
        zeros = lambda kind, n, dtype: torch.zeros(n, dtype=dtype)  # noqa: E731  the states in RAM
        inner.state[master] = {"step": torch.tensor(0.0), **statefmt.allocate(fmt, b, zeros)}
        step = (lambda: cpu_adam.step(inner, master, grad, 1.0)) if fmt == "fp32" else \
            (lambda: statefmt.step(inner, master, grad, 1.0, b, 0, True))
    times = []
    for i in range(warmup + repeats):
        began = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - began)
    return b.numel, statistics.median(times)


def rates(params: int = CALIBRATION_PARAMS) -> dict[str, float]:
    """Parameters a second of torch's fused AdamW ("torch") and, where a C compiler built bigfit's
    kernel, of each format, on every core this process may use."""
    out = {}
    for fmt in ("torch", *(KERNEL_FORMATS if cpu_adam.kernel() is not None else ())):
        n, seconds = step_seconds(fmt, params)
        out[fmt] = n / seconds
    return out

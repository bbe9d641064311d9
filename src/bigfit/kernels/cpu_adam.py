"""The offload engine's host optimizer step: bigfit's own Adam/AdamW kernel (kernels/csrc/cpu_adam.c) where a C
compiler is there to build it, else torch's fused CPU AdamW.

Why bigfit's own: the host step is memory-bound (RESULTS.md), and torch's fused step needs fp32
gradients and, given a gradient scale, writes the unscaled gradient back: 40 bytes of host memory
traffic a parameter, the DMA's included. This kernel reads bf16 gradients as they come off the
device and leaves them: 32. And it hands out chunks to threads as they come free, where a static
split waits for the thread that shares a core with training (0.88 -> 0.76 s a step at 3.6B on the
H200 machine). It is built once per machine with the
system compiler into ~/.cache/bigfit (`BIGFIT_CACHE` overrides), the file named by a hash of the
source, the flags and the CPU's features, so a shared home never hands one CPU another's build.
`BIGFIT_CPU_ADAM=0` turns it off (benchmarks compare both).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources

import torch

from ..common.distributed import cores_per_rank

# -ffp-contract=off: each operation rounds as torch's do (no fused multiply-adds), so the compact
# formats' plain-torch reference (offload/stateref.py) matches the kernel bit for bit
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared"]


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(source: bytes) -> str | None:
    """The built library's path, or None where there is no compiler or it fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_features().encode()).hexdigest()[:16]
    cache = os.environ.get("BIGFIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "bigfit")
    path = os.path.join(cache, f"cpu_adam-{platform.machine()}-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # several ranks may build at once: rename wins
        src, out = os.path.join(tmp, "cpu_adam.c"), os.path.join(tmp, "cpu_adam.so")
        with open(src, "wb") as f:
            f.write(source)
        done = subprocess.run([cc, *FLAGS, src, "-o", out], capture_output=True)
        if done.returncode != 0:
            return None
        os.replace(out, path)
    return path


@functools.lru_cache(maxsize=None)
def library():
    """The built kernels (ctypes releases the GIL while they run), or None."""
    if os.environ.get("BIGFIT_CPU_ADAM", "1") == "0":
        return None
    try:
        path = _build(resources.files("bigfit.kernels").joinpath("csrc/cpu_adam.c").read_bytes())
        lib = ctypes.CDLL(path) if path else None
    except OSError:
        return None
    if lib is not None:
        f, i, i64, u32, ptr = ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p
        hyper = [i, f, f, f, f, f, f, f, f, f]
        lib.bigfit_adam_step.argtypes = [ptr, ptr, i, ptr, ptr, i64, *hyper, i]
        lib.bigfit_adam_step_bf16.argtypes = [ptr, ptr, i, ptr, ptr, i64, i64, u32, *hyper, i]
        lib.bigfit_adam_step_int8.argtypes = [ptr, ptr, i, ptr, ptr, ptr, ptr, i64, i64, *hyper, i]
        for fn in (lib.bigfit_adam_step, lib.bigfit_adam_step_bf16, lib.bigfit_adam_step_int8):
            fn.restype = i
    return lib


def kernel():
    """The fp32 kernel's function, or None."""
    lib = library()
    return lib.bigfit_adam_step if lib is not None else None


def supports(inner: torch.optim.Optimizer) -> bool:
    """The kernel does plain Adam/AdamW: not amsgrad, maximize or tensor learning rates."""
    group = inner.param_groups[0]
    return (kernel() is not None and isinstance(inner, torch.optim.Adam | torch.optim.AdamW)
            and not group.get("amsgrad") and not group.get("maximize") and not torch.is_tensor(group["lr"]))


def _decoupled(inner: torch.optim.Optimizer) -> bool:
    return bool(inner.param_groups[0].get("decoupled_weight_decay", isinstance(inner, torch.optim.AdamW)))


def hyper(inner: torch.optim.Optimizer, t: float, grad_scale: float) -> tuple:
    """The kernels' coefficients after `t` steps, in double as torch computes them, in their order:
    decoupled, decay, l2, 1 - beta1, beta2, 1 - beta2, eps, step size, sqrt(bias correction 2), grad scale."""
    group = inner.param_groups[0]
    (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
    decoupled = _decoupled(inner)
    return (int(decoupled), 1 - lr * wd, 0.0 if decoupled else wd, 1 - beta1, beta2, 1 - beta2, group["eps"],
            lr / (1 - beta1 ** t), math.sqrt(1 - beta2 ** t), grad_scale)


def step(inner: torch.optim.Optimizer, master: torch.Tensor, grad: torch.Tensor, grad_scale: float) -> None:
    """One step of `inner`'s single flat fp32 `master` with `grad` (fp32 or bf16) divided by
    `grad_scale`, through the kernel; `inner`'s hyperparameters and state (exp_avg, exp_avg_sq, step)."""
    st = inner.state[master]
    for t in (master, st["exp_avg"], st["exp_avg_sq"]):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.numel() == master.numel()
    assert grad.dtype in (torch.float32, torch.bfloat16) and grad.is_contiguous() and grad.numel() == master.numel()
    st["step"] += 1
    kernel()(master.data_ptr(), grad.data_ptr(), int(grad.dtype == torch.bfloat16), st["exp_avg"].data_ptr(),
             st["exp_avg_sq"].data_ptr(), master.numel(), *hyper(inner, float(st["step"]), grad_scale),
             cores_per_rank())

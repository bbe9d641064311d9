"""What the trace's forward dispatches, per block: the operators the host issues (hostcost.py) and
the bytes the non-matmul ones move on the device (devicecost.py). A TorchDispatchMode over the
fake-tensor forward of profile.py, which sets `current[0]` to the block running (-1 outside)."""
from __future__ import annotations

import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


class OpCounter(TorchDispatchMode):
    """Counts the operators the forward dispatches, per block (`current[0]`, as the trace's hooks set it)
    and outside: a view or a shape query launches nothing, every other operator is a kernel (or an
    allocation) the host must issue in eager mode. Beside the count, the bytes every operator but the
    matmuls and attention reads and writes (its tensor inputs other than parameters, and its outputs):
    the memory traffic of norms, activations, dropout, residual adds and casts, which bound the GPU's
    time where FLOPs do not (T5's norms and residual stream, in fp32 under autocast). And the FLOPs of
    the matmuls that run in fp32 in a job whose compute dtype is lower (`mixed`): they miss the tensor
    cores' rate (T5's self-attention on SDPA's math path, cudatrace.py's cuda_kernels)."""

    def __init__(self, current: list[int], n_blocks: int, params: set, mixed: bool = False):
        super().__init__()
        self.current, self.blocks, self.other = current, [0] * n_blocks, 0
        self.params, self.block_bytes, self.other_bytes = params, [0] * n_blocks, 0
        self.mixed, self.block_fp32_flops = mixed, [0] * n_blocks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or _METADATA.search(func.__name__):
            return out
        moved = 0 if _COMPUTE.fullmatch(func.__name__.split(".")[0]) else _bytes_of((args, kwargs), self.params) + _bytes_of(out, ())
        if self.current[0] >= 0:
            self.blocks[self.current[0]] += 1
            self.block_bytes[self.current[0]] += moved
            if self.mixed and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
                self.block_fp32_flops[self.current[0]] += _matmul_flops(func.__name__.split(".")[0], args, out)
        else:
            self.other += 1
            self.other_bytes += moved
        return out


def _matmul_flops(name: str, args, out) -> int:
    """A forward matmul's FLOPs (2 x its output's elements x the inner dimension); 0 for other operators."""
    if name in ("mm", "bmm"):
        return 2 * out.numel() * args[0].shape[-1]
    if name in ("addmm", "baddbmm"):
        return 2 * out.numel() * args[1].shape[-1]
    return 0


def _bytes_of(tree, params) -> int:
    if isinstance(tree, torch.Tensor):
        return 0 if _storage_key(tree) in params else tree.numel() * tree.element_size()
    if isinstance(tree, (list, tuple)):
        return sum(_bytes_of(x, params) for x in tree)
    if isinstance(tree, dict):
        return sum(_bytes_of(x, params) for x in tree.values())
    return 0


# FLOP-bound operators (their time is the FLOP count's), and the ones that move no bytes of their own
_COMPUTE = re.compile(r"(mm|addmm|bmm|baddbmm|_scaled_dot_product.*|_flash.*|_efficient.*|convolution|embedding|"
                      r"empty.*|new_empty.*|_unsafe_view|device)")
_METADATA = re.compile(r"^(sym_|size|stride|dim|numel|is_|_local_scalar_dense|detach|lift_fresh)")

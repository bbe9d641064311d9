"""The offload engine's optimizer-state formats (`--optimizer-states`): how Adam's two moments are
kept in host RAM (or NVMe files) beside the fp32 master weights, per bucket (buckets.py's flat layout).

- fp32: 4 + 4 bytes a parameter, torch's own layout (12 with the master).
- bf16: 2 + 2 bytes, stochastically rounded (cpu_adam.c says why): 8 with the master.
- int8: 1 + 1 bytes and an fp32 scale per block of 256 of a row for each moment (the first moment a
  signed 8-bit float code, the second its square root's unsigned code; cpu_adam.c): about 6 bytes.
  Blocks never cross a row, and ranks own whole rows (buckets.py), so a parameter's codes and its
  scales (rows x blocks a row) shard by rows like the parameter: checkpoints keep them as they are
  and reshard them to any number of ranks.

The kernel (cpu_adam.c) steps each format; stateref.py's `reference_step` is the same arithmetic in
plain torch, which the tests hold the kernel to bit for bit and which steps where no C compiler built
the kernel. `to_fp32` / `from_fp32` convert between formats (a checkpoint saved in another).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.distributed import cores_per_rank
from ..kernels import cpu_adam
from ..settings.config import STATE_BYTES
from .buckets import Bucket
from .stateref import Segment, dequantize, quantize, reference_step

FORMATS = ("fp32", "bf16", "int8")
MOMENTS = ("exp_avg", "exp_avg_sq")
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


def bytes_per_parameter(fmt: str) -> float:
    """Host bytes of master weights and moments a parameter (config.STATE_BYTES, which the planner
    reads; for int8 exact where rows are whole blocks of 256: the tests hold `allocate` to it)."""
    return STATE_BYTES[fmt]


def segments(b: Bucket, rank: int = 0) -> list[Segment]:
    """Each slot's place in the bucket's flat states on data-parallel rank `rank` (stateref.Segment)."""
    out, scales, whole = [], 0, 0
    for s in b.slots:
        out.append(Segment(s.offset, s.rows, s.row_numel, scales, whole + rank * s.rows * s.row_numel))
        scales += out[-1].rows * out[-1].blocks
        whole += s.param.numel()
    return out


def allocate(fmt: str, b: Bucket, zeros: Callable[[str, int, torch.dtype], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bucket's moments in `fmt`, from `zeros(kind, numel, dtype)` (host RAM or NVMe files)."""
    out = {k: zeros(k, b.numel, DTYPE[fmt]) for k in MOMENTS}
    if fmt == "int8":
        n = sum(seg.rows * seg.blocks for seg in segments(b))
        out.update({f"{k}_scale": zeros(f"{k}_scale", n, torch.float32) for k in MOMENTS})
    return out


def format_of(states: dict) -> str:
    return "int8" if "exp_avg_scale" in states else "bf16" if states["exp_avg"].dtype == torch.bfloat16 else "fp32"


def seed(step: int, bucket: int) -> int:
    """The stochastic rounding's seed of a bucket's step: another stream of bits every step."""
    return (step * 0x9E3779B1 + bucket * 0x85EBCA6B + 0x632BE5AB) & 0xFFFFFFFF


# -- the step -----------------------------------------------------------------------------------------
def step(inner: torch.optim.Optimizer, master: torch.Tensor, grad: torch.Tensor, grad_scale: float, b: Bucket,
         rank: int, use_kernel: bool) -> None:
    """One compact-format step of the bucket's master rows (this data-parallel `rank`'s) and moments
    (inner.state[master]) with `grad` / `grad_scale`: the kernel, or `reference_step` without it."""
    st = inner.state[master]
    st["step"] += 1
    t = int(st["step"])
    h, fmt, segs = cpu_adam.hyper(inner, float(t), grad_scale), format_of(st), segments(b, rank)
    if not use_kernel:
        reference_step(fmt, master, grad, st, h, segs, seed(t, b.index))
        return
    lib, bf16 = cpu_adam.library(), int(grad.dtype == torch.bfloat16)
    for seg in segs:
        e, s = seg.elements, seg.scales
        if e.stop == e.start:
            continue
        if fmt == "bf16":
            lib.bigfit_adam_step_bf16(_at(master, e), _at(grad, e), bf16, _at(st["exp_avg"], e),
                                      _at(st["exp_avg_sq"], e), e.stop - e.start, seg.index0, seed(t, b.index), *h,
                                      cores_per_rank())
        else:
            lib.bigfit_adam_step_int8(_at(master, e), _at(grad, e), bf16, _at(st["exp_avg"], e),
                                      _at(st["exp_avg_sq"], e), _at(st["exp_avg_scale"], s),
                                      _at(st["exp_avg_sq_scale"], s), seg.rows, seg.row_numel, *h, cores_per_rank())


def _at(t: torch.Tensor, part: slice) -> int:
    return t[part].data_ptr()


# -- conversions -------------------------------------------------------------------------------------
def to_fp32(states: dict, b: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
    """A bucket's moments in fp32, whatever their format."""
    if format_of(states) != "int8":
        return states["exp_avg"].float(), states["exp_avg_sq"].float()
    m, v = torch.zeros(b.numel), torch.zeros(b.numel)
    for seg in segments(b):
        els, sc = seg.elements, seg.scales
        if els.stop > els.start:
            m[els], v[els] = dequantize(states["exp_avg"][els], states["exp_avg_scale"][sc], states["exp_avg_sq"][els],
                                        states["exp_avg_sq_scale"][sc], seg)
    return m, v


def from_fp32(m: torch.Tensor, v: torch.Tensor, states: dict, b: Bucket) -> None:
    """fp32 moments into a bucket's states of any format (rounded to nearest)."""
    if format_of(states) != "int8":
        states["exp_avg"].copy_(m)
        states["exp_avg_sq"].copy_(v)
        return
    for seg in segments(b):
        els, sc = seg.elements, seg.scales
        if els.stop > els.start:
            quantize(m[els], v[els], seg, states["exp_avg"][els], states["exp_avg_scale"][sc],
                     states["exp_avg_sq"][els], states["exp_avg_sq_scale"][sc])

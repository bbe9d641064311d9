"""The offload engine's optimizer-state formats (`--optimizer-states`): how Adam's two moments are
kept in host RAM (or NVMe files) beside the fp32 master weights, per bucket (buckets.py's flat layout).

- fp32: 4 + 4 bytes a parameter, torch's own layout (12 with the master).
- bf16: 2 + 2 bytes, stochastically rounded (cpu_adam.c says why): 8 with the master.
- int8: 1 + 1 bytes and an fp32 scale per block of 256 of a row for each moment (the first moment a
  signed 8-bit float code, the second its square root's unsigned code; cpu_adam.c): about 6 bytes.
  Blocks never cross a row, and ranks own whole rows (buckets.py), so a parameter's codes and its
  scales (rows x blocks a row) shard by rows like the parameter: checkpoints keep them as they are
  and reshard them to any number of ranks.

The kernel (cpu_adam.c) steps each format; `reference_step` is the same arithmetic in plain torch,
which the tests hold the kernel to bit for bit and which steps where no C compiler built the kernel.
`to_fp32` / `from_fp32` convert between formats (a checkpoint saved in another).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import STATE_BYTES
from ..distributed import cores_per_rank
from . import cpu_adam
from .buckets import Bucket

FORMATS = ("fp32", "bf16", "int8")
BLOCK = 256  # cpu_adam.c's BLOCK
MOMENTS = ("exp_avg", "exp_avg_sq")
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


def bytes_per_parameter(fmt: str) -> float:
    """Host bytes of master weights and moments a parameter (config.STATE_BYTES, which the planner
    reads; for int8 exact where rows are whole blocks of 256: the tests hold `allocate` to it)."""
    return STATE_BYTES[fmt]


@dataclass(frozen=True)
class Segment:
    """One slot's elements in its bucket's flat rows (`offset`, `rows` x `row_numel`, padding rows
    included), for int8 its blocks' scales (`scale_offset`, `rows` x `blocks`), and for bf16's
    stochastic rounding the index of its first element in the whole bucket (`index0`), which is
    the same for any number of ranks: every layout draws the same bits for an element."""
    offset: int
    rows: int
    row_numel: int
    scale_offset: int
    index0: int

    @property
    def blocks(self) -> int:
        return -(-self.row_numel // BLOCK)


def segments(b: Bucket, rank: int = 0) -> list[Segment]:
    out, scales, whole = [], 0, 0
    for s in b.slots:
        out.append(Segment(s.offset, s.rows, s.row_numel, scales, whole + rank * s.rows * s.row_numel))
        scales += out[-1].rows * out[-1].blocks
        whole += s.param.numel()
    return out


def allocate(fmt: str, b: Bucket, zeros: Callable[[str, int, torch.dtype], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bucket's moments in `fmt`, from `zeros(kind, numel, dtype)` (pinned RAM or NVMe files)."""
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
        n = seg.rows * seg.row_numel
        if n == 0:
            continue
        e, s = (seg.offset, n), (seg.scale_offset, seg.rows * seg.blocks)
        if fmt == "bf16":
            lib.bigfit_adam_step_bf16(_at(master, *e), _at(grad, *e), bf16, _at(st["exp_avg"], *e),
                                      _at(st["exp_avg_sq"], *e), n, seg.index0, seed(t, b.index), *h, cores_per_rank())
        else:
            lib.bigfit_adam_step_int8(_at(master, *e), _at(grad, *e), bf16, _at(st["exp_avg"], *e),
                                      _at(st["exp_avg_sq"], *e), _at(st["exp_avg_scale"], *s),
                                      _at(st["exp_avg_sq_scale"], *s), seg.rows, seg.row_numel, *h, cores_per_rank())


def _at(t: torch.Tensor, start: int, n: int) -> int:
    return t[start:start + n].data_ptr()


# -- the same in plain torch ----------------------------------------------------------------------------
def reference_step(fmt: str, p: torch.Tensor, grad: torch.Tensor, st: dict, h: tuple, segs: list[Segment],
                   seed_: int) -> None:
    """cpu_adam.c's arithmetic, operation for operation in fp32 (`h`: cpu_adam.hyper's coefficients)."""
    c = [torch.tensor(x, dtype=torch.float32) for x in h[1:]]
    scale = c[-1]
    for seg in segs:
        n = seg.rows * seg.row_numel
        if n == 0:
            continue
        els, sc = slice(seg.offset, seg.offset + n), slice(seg.scale_offset, seg.scale_offset + seg.rows * seg.blocks)
        if fmt == "bf16":
            m, v = st["exp_avg"][els].float(), st["exp_avg_sq"][els].float()
            p[els] = _adam(p[els], grad[els].float() / scale, m, v, h[0], c)
            r = _mix32(_mul32(torch.arange(seg.index0, seg.index0 + n, dtype=torch.int64) & 0xFFFFFFFF,
                              0x9E3779B1) ^ seed_)
            st["exp_avg"][els] = _bf16_stochastic(m, r)
            st["exp_avg_sq"][els] = _bf16_stochastic(v, r >> 16)
            continue
        m, v = dequantize(st["exp_avg"][els], st["exp_avg_scale"][sc], st["exp_avg_sq"][els],
                          st["exp_avg_sq_scale"][sc], seg)
        p[els] = _adam(p[els], grad[els].float() / scale, m, v, h[0], c)
        quantize(m, v, seg, st["exp_avg"][els], st["exp_avg_scale"][sc], st["exp_avg_sq"][els], st["exp_avg_sq_scale"][sc])


def _adam(w, g, m, v, decoupled: int, c) -> torch.Tensor:
    """cpu_adam.c's `adam`: m and v updated in place, the new weights returned."""
    decay, l2, omb1, beta2, omb2, eps, step_size, bc2, _ = c
    if decoupled:
        w = w * decay
    else:
        g = g + l2 * w
    m.copy_(m + (g - m) * omb1)
    v.copy_(v * beta2 + omb2 * g * g)
    return w - step_size * m / (_sqrt(v) / bc2 + eps)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrtf's correctly rounded root: torch's vectorised fp32 sqrt is 1 ulp off for some inputs
    (torch 2.13 on this CPU); fp64's root rounded to fp32 is exact."""
    return torch.sqrt(x.double()).float()


def _mul32(a: torch.Tensor, k: int) -> torch.Tensor:
    """(a * k) mod 2**32 for a in [0, 2**32), without overflowing int64."""
    return (a * (k & 0xFFFF) + (((a * (k >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _bf16_stochastic(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    bits = ((x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) + (r & 0xFFFF)) >> 16
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16)


def _code8(x: torch.Tensor, man: int) -> torch.Tensor:
    """cpu_adam.c's code8: x in [0, 1] to its 8-bit float code (int64)."""
    low = (x * float(1 << (14 + man)) + 0.5).to(torch.int64)
    bits = x.view(torch.int32).to(torch.int64) + (1 << (22 - man))
    normal = (((bits >> 23) - 112) << man) | ((bits >> (23 - man)) & ((1 << man) - 1))
    return torch.where(x < 2.0 ** -14, low, normal)


def _value8(code: torch.Tensor, man: int) -> torch.Tensor:
    code = code.to(torch.int64)
    low = code.float() * (1.0 / (1 << (14 + man)))
    bits = (((code >> man) + 112) << 23) | ((code & ((1 << man) - 1)) << (23 - man))
    return torch.where(code < (1 << man), low, bits.to(torch.int32).view(torch.float32))


def _blocks(x: torch.Tensor, seg: Segment) -> torch.Tensor:
    """(rows x row_numel) -> (rows x blocks, BLOCK), the last block of each row padded with zeros."""
    rows = x.view(seg.rows, seg.row_numel)
    pad = seg.blocks * BLOCK - seg.row_numel
    return torch.nn.functional.pad(rows, (0, pad)).view(-1, BLOCK)


def _unblock(x: torch.Tensor, seg: Segment) -> torch.Tensor:
    return x.view(seg.rows, seg.blocks * BLOCK)[:, :seg.row_numel].reshape(-1)


def dequantize(m_codes, m_scale, v_codes, v_scale, seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's int8 moments as fp32 values (flat, the slot's rows)."""
    mc = _blocks(m_codes.to(torch.int64), seg)
    m = _value8(mc & 0x7F, 3) * m_scale.view(-1, 1)
    m = torch.where(mc >= 0x80, -m, m)
    s = _value8(_blocks(v_codes, seg), 4) * v_scale.view(-1, 1)
    return _unblock(m, seg), _unblock(s * s, seg)


def quantize(m, v, seg: Segment, m_codes, m_scale, v_codes, v_scale) -> None:
    """One slot's fp32 moments into its int8 codes and block scales (in place)."""
    mb, sb = _blocks(m, seg), _blocks(_sqrt(v), seg)
    m_max, s_max = mb.abs().amax(1), sb.amax(1)
    m_inv = torch.where(m_max > 0, 1.0 / m_max, torch.zeros_like(m_max)).view(-1, 1)
    s_inv = torch.where(s_max > 0, 1.0 / s_max, torch.zeros_like(s_max)).view(-1, 1)
    mc = (mb < 0).to(torch.int64) << 7 | _code8(torch.clamp(mb.abs() * m_inv, max=1.0), 3)
    m_codes.copy_(_unblock(mc, seg))
    v_codes.copy_(_unblock(_code8(torch.clamp(sb * s_inv, max=1.0), 4), seg))
    m_scale.copy_(m_max)
    v_scale.copy_(s_max)


# -- conversions -------------------------------------------------------------------------------------
def to_fp32(states: dict, b: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
    """A bucket's moments in fp32, whatever their format."""
    if format_of(states) != "int8":
        return states["exp_avg"].float(), states["exp_avg_sq"].float()
    m, v = torch.zeros(b.numel), torch.zeros(b.numel)
    for seg in segments(b):
        n, k = seg.rows * seg.row_numel, seg.rows * seg.blocks
        if n:
            els, sc = slice(seg.offset, seg.offset + n), slice(seg.scale_offset, seg.scale_offset + k)
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
        n, k = seg.rows * seg.row_numel, seg.rows * seg.blocks
        if n:
            els, sc = slice(seg.offset, seg.offset + n), slice(seg.scale_offset, seg.scale_offset + k)
            quantize(m[els], v[els], seg, states["exp_avg"][els], states["exp_avg_scale"][sc],
                     states["exp_avg_sq"][els], states["exp_avg_sq_scale"][sc])

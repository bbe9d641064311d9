"""The compact optimizer-state formats' arithmetic in plain torch (statefmt.py): `reference_step`, the
kernel's step (kernels/csrc/cpu_adam.c) operation for operation in fp32, which the tests hold the kernel to bit
for bit and which steps where no C compiler built it; `quantize` / `dequantize`, one slot's int8
moments to and from fp32 values; and `Segment`, a slot's place in its bucket."""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 256  # cpu_adam.c's BLOCK: int8 scales cover blocks of this many elements of a row


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

    @property
    def elements(self) -> slice:
        """Its elements in the bucket's flat states (empty for a slot without any)."""
        return slice(self.offset, self.offset + self.rows * self.row_numel)

    @property
    def scales(self) -> slice:
        """Its int8 block scales in the bucket's flat scale tensors."""
        return slice(self.scale_offset, self.scale_offset + self.rows * self.blocks)


def reference_step(fmt: str, p: torch.Tensor, grad: torch.Tensor, st: dict, h: tuple, segs: list[Segment],
                   seed_: int) -> None:
    """cpu_adam.c's arithmetic, operation for operation in fp32 (`h`: cpu_adam.hyper's coefficients)."""
    c = [torch.tensor(x, dtype=torch.float32) for x in h[1:]]
    scale = c[-1]
    for seg in segs:
        els, sc = seg.elements, seg.scales
        if els.stop == els.start:
            continue
        if fmt == "bf16":
            m, v = st["exp_avg"][els].float(), st["exp_avg_sq"][els].float()
            p[els] = _adam(p[els], grad[els].float() / scale, m, v, h[0], c)
            index = torch.arange(seg.index0, seg.index0 + els.stop - els.start, dtype=torch.int64)
            r = _mix32(_mul32(index & 0xFFFFFFFF, 0x9E3779B1) ^ seed_)
            st["exp_avg"][els] = _bf16_stochastic(m, r)
            st["exp_avg_sq"][els] = _bf16_stochastic(v, r >> 16)
            continue
        m, v = dequantize(st["exp_avg"][els], st["exp_avg_scale"][sc], st["exp_avg_sq"][els],
                          st["exp_avg_sq_scale"][sc], seg)
        p[els] = _adam(p[els], grad[els].float() / scale, m, v, h[0], c)
        quantize(m, v, seg, st["exp_avg"][els], st["exp_avg_scale"][sc], st["exp_avg_sq"][els],
                 st["exp_avg_sq_scale"][sc])


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

"""Two changes to torchao's NF4Tensor (quantize.py's store for a sharded base), put on its class for
this process by `install()`; everything else about the tensor (F.linear's dispatch, split, copies,
quantisation) stays torchao's.

- FSDP2's all-gather as one packed byte tensor a parameter. torchao hands FSDP2 three all-gather
  inputs (the 8-bit absmaxes, their factors, the 4-bit codes); FSDP2's path for one rank
  (`FSDPParamGroup.wait_for_unshard`, torch 2.11 to 2.13) copies only the first input of such a
  tensor, so zero3 and zero3-offload on one GPU (a 70B base in host RAM under a card too small to
  hold it) fail at the first forward. One uint8 input, each rank's share being [absmaxes | factors |
  codes] as bytes, serves that path and the collective alike.
- The dequantisation every matmul runs in forward and backward, through a 256-entry table of byte ->
  its two code values: 10.6 bytes a weight moved and 4 held at once, where torchao's own (each half
  of the bytes made int64 indices, looked up and scaled apart, then stacked) moves 33 and holds 14.
  Bit for bit the same values (tests/test_qlora_strategies.py).
"""
from __future__ import annotations

import torch

INNER = ("quantized_scalers", "quantization_factor", "quantized_data")


def install(cls) -> None:
    if "torchao_dequantized" not in vars(cls):
        cls.torchao_dequantized = cls.get_original_weight  # torchao's own, the reference of the tests
    cls.fsdp_pre_all_gather = _pre_all_gather
    cls.fsdp_post_all_gather = _post_all_gather
    cls.get_original_weight = _dequantized


def _pairs(code: torch.Tensor) -> torch.Tensor:
    """byte b -> (code[b >> 4], code[b & 15]); made once per device and dtype (every matmul asks)."""
    key = (code.device, code.dtype)
    if key not in _PAIRS:
        _PAIRS[key] = torch.stack([code.repeat_interleave(16), code.repeat(16)], -1)
    return _PAIRS[key]


_PAIRS: dict = {}  # NF4's 16 values are one constant in torchao: one table serves every tensor


def _dequantized(self) -> torch.Tensor:
    """The weight in its dtype: each byte's two codes looked up at once, scaled by its block's absmax."""
    pairs = _pairs(self.nf4)
    absmax = self.dequantize_scalers(self.quantized_scalers, self.quantization_factor, self.scaler_block_size)
    weights = pairs[self.quantized_data.int()]
    return (weights.view(-1, self.block_size) * absmax.unsqueeze(-1)).view(self.shape)


def _pre_all_gather(self, mesh):
    parts = [getattr(self, name).reshape(-1).view(torch.uint8) for name in INNER]
    widths = tuple(p.numel() for p in parts)
    meta = (self.size(), self.dtype, self.block_size, self.scaler_block_size, self.scaler_mean, self.nf4,
            self.quantized_scalers.dtype, self.quantization_factor.dtype, widths, mesh.size())
    return (torch.cat(parts),), meta


def _post_all_gather(self, outputs, meta, param_dtype, *, out=None):
    """The whole layer's NF4Tensor over the gathered bytes: its inner tensors are copies, so FSDP2 can
    free and reallocate them between steps (`out`: the tensor made at the first gather, refilled)."""
    (packed,) = outputs
    size, dtype, block, scaler_block, mean, code, scalers_dtype, factor_dtype, widths, world = meta
    rows = packed.view(world, -1)
    cuts = [0, widths[0], widths[0] + widths[1], sum(widths)]
    columns = [rows[:, a:b] for a, b in zip(cuts, cuts[1:])]
    if out is not None:
        for name, src in zip(INNER, columns):
            getattr(out, name).view(torch.uint8).view(world, -1).copy_(src)
        return None
    scalers, factor, data = (c.clone().view(-1).view(d) for c, d in
                             zip(columns, (scalers_dtype, factor_dtype, torch.uint8)))
    whole = torch.Size((size[0] * world, *size[1:]))
    tensor = type(self)(_args(whole, dtype, packed.device), block, whole.numel() // block, scaler_block, scalers,
                        factor, mean, data, code)
    return tensor, (scalers, factor, data)


def _args(size: torch.Size, dtype, device):
    """torchao's SubclassTensorArgs for a contiguous tensor (its module moved between releases)."""
    try:
        from torchao.dtypes.nf4tensor import SubclassTensorArgs
    except ImportError:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import SubclassTensorArgs
    return SubclassTensorArgs(size, (size[1], 1), 0, dtype, device, False)

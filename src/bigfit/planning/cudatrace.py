"""The kernels a CUDA job runs where the CPU's differ, for profile.py's trace on CPU fake tensors:
CUDA autocast's casting policy (`CudaAutocast`), SDPA's fused kernels and dropout's (`cuda_kernels`)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_LOWER = {F.linear, torch.matmul, torch.mm, torch.addmm, torch.bmm, torch.baddbmm, torch.Tensor.matmul,
          torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm, F.conv1d, F.conv2d, torch.einsum}
_FP32 = {F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
         torch.Tensor.log_softmax, torch.pow, torch.Tensor.pow, torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log,
         torch.rsqrt, torch.Tensor.rsqrt, torch.sum, torch.Tensor.sum, torch.cumsum, torch.Tensor.cumsum, torch.norm,
         torch.Tensor.norm, F.cross_entropy, F.mse_loss, torch.logsumexp, torch.Tensor.logsumexp}


class CudaAutocast(torch.overrides.TorchFunctionMode):
    """CUDA autocast's policy, for a trace on CPU fake tensors (CPU autocast casts other ops): the
    matmul family in the compute dtype, the precision-sensitive ops in fp32, the rest as given."""

    def __init__(self, dtype: torch.dtype, model: torch.nn.Module):
        super().__init__()
        self.dtype, self.params = dtype, {id(p) for p in model.parameters()}
        self.weight_casts: set = set()
        # the casts themselves, kept: a freed one's storage key could be a later activation's, which
        # `pack` would then skip (an 8B Llama's autocast trace varied by 0.2 GB between runs)
        self.kept: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = self.dtype if func in _LOWER else torch.float32 if func in _FP32 else None
        if target is not None:
            args, kwargs = self._cast((args, kwargs), target)
        return func(*args, **kwargs)

    def _cast(self, tree, dtype):
        if isinstance(tree, torch.Tensor) and tree.is_floating_point() and tree.dtype != dtype:
            out = tree.to(dtype)
            if id(tree) in self.params:
                self.weight_casts.add(out.untyped_storage()._cdata)  # profile.py's storage key
                self.kept.append(out)
            return out
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._cast(x, dtype) for x in tree)
        if isinstance(tree, dict):
            return {k: self._cast(v, dtype) for k, v in tree.items()}
        return tree


class _FusedSDPA(torch.autograd.Function):
    """What CUDA's flash / memory-efficient attention keeps for backward: its inputs, its output and
    the fp32 log-sum-exp per query (and a mask, if given). Shapes only: it runs on fake tensors."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a planning stand-in: never differentiated")


@contextlib.contextmanager
def cuda_kernels():
    """The kernels CUDA runs where the CPU's differ, for a trace on CPU fake tensors: SDPA's fused
    kernels (`_FusedSDPA`) and dropout's one fused kernel (a bool mask; the CPU's draws a mask in the
    input's dtype, scales it and multiplies: four operators, 2.8 times the bytes, a mask twice the
    size). SDPA runs its math path where CUDA does: a floating mask that needs a gradient (T5's
    relative position bias, a trained parameter's output), which no fused kernel differentiates.
    The math path runs as it would there, with the inputs autocast gives it and in fp32 (torch
    upcasts half inputs unless told otherwise): T5-large saves 5 MB more per self-attention layer and
    sample than the kernels would, and issues a dozen operators in place of one (measured on the
    H200: cuDNN for T5's cross-attention, math for self-attention)."""
    real_sdpa, real_dropout = F.scaled_dot_product_attention, F.dropout

    def sdpa(q, k, v, attn_mask=None, *args, **kwargs):
        if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad:
            return real_sdpa(q, k, v, attn_mask.to(q.dtype), *args, **kwargs)
        return _FusedSDPA.apply(q, k, v, attn_mask)

    def dropout(input, p=0.5, training=True, inplace=False):  # noqa: A002  F.dropout's own names
        if training and 0 < p < 1 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return real_dropout(input, p, training, inplace)
    F.scaled_dot_product_attention, F.dropout = sdpa, dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.dropout = real_sdpa, real_dropout

"""OffloadAdamW's refusals: each a one-line BigfitError naming what was given and what to do instead,
raised before any host memory is allocated. OffloadAdamW steps whole, plain tensors of one process:
parameters another wrapper has sharded (FSDP2 / tensor parallel DTensors, FSDP1 flat parameters,
DeepSpeed ZeRO-3) hold only a piece, and data parallelism reduces gradients after OffloadAdamW has
taken them (its hooks run as each gradient is accumulated, before DDP's all-reduce lands)."""
from __future__ import annotations

import math

import torch

from ..errors import BigfitError, one_of
from ..offload.statefmt import FORMATS

WHOLE = "bigfit.prepare(model, strategy='zero2-offload' or 'zero3-offload'), which shards and offloads together"


def _is_dtensor(p: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def check_parameter(i: int, p) -> None:
    """Parameter `i` (its index among those given) is a tensor OffloadAdamW can step."""
    what = f"parameter {i} (shape {tuple(p.shape)}, {p.dtype})" if torch.is_tensor(p) else f"parameter {i}"
    if not torch.is_tensor(p):
        raise BigfitError(f"OffloadAdamW: {what} is a {type(p).__name__}, not a tensor; pass model.parameters() "
                          "or groups of parameters ({'params': [...], 'lr': ...})")
    if _is_dtensor(p):
        raise BigfitError(f"OffloadAdamW: {what} is a DTensor (sharded by FSDP2 or tensor parallel); OffloadAdamW "
                          f"steps whole tensors: use {WHOLE}, or torch.optim.AdamW")
    if getattr(p, "_is_flat_param", False) or hasattr(p, "ds_id"):
        owner = "FSDP" if getattr(p, "_is_flat_param", False) else "DeepSpeed ZeRO"
        raise BigfitError(f"OffloadAdamW: {what} is flattened and sharded by {owner}; OffloadAdamW steps whole "
                          f"tensors: use {WHOLE}, or {owner}'s own optimizer offload")
    if not p.requires_grad:
        return  # frozen: skipped (no host state, no hook), as torch's optimizers never step it
    if p.is_sparse or p.layout != torch.strided:
        raise BigfitError(f"OffloadAdamW: {what} has layout {p.layout}; it steps dense (strided) tensors only: "
                          "use torch.optim.SparseAdam for sparse parameters")
    if not p.is_floating_point():
        raise BigfitError(f"OffloadAdamW: {what} is not a real floating-point tensor; it steps float32, bfloat16 "
                          "and float16 parameters: use torch.optim.AdamW for complex ones")
    if p.device.type == "meta":
        raise BigfitError(f"OffloadAdamW: {what} is on the meta device (no values to copy); materialise the "
                          "model first (model.to_empty(device=...) and load or initialise its weights)")
    if not p.is_leaf:
        raise BigfitError(f"OffloadAdamW: {what} is not a leaf tensor (it is computed from others); pass the "
                          "model's parameters (model.parameters())")


def check_group(group: dict, first: int, seen: set[int]) -> None:
    """A param group's parameters (numbered from `first`) and hyperparameters; `seen`: ids so far."""
    for i, p in enumerate(group["params"], first):
        check_parameter(i, p)
        if id(p) in seen:
            raise BigfitError(f"OffloadAdamW: parameter {i} appears more than once (in one group or two); "
                              "give each parameter to one group once")
        seen.add(id(p))
    check_hyper(group)


def check_hyper(group: dict) -> None:
    lr, betas, eps, wd = (group.get(k) for k in ("lr", "betas", "eps", "weight_decay"))
    if lr is not None and not (float(lr) >= 0 and math.isfinite(float(lr))):
        raise BigfitError(f"OffloadAdamW: lr {lr!r} is not valid; give a finite learning rate >= 0")
    if betas is not None and not (len(betas) == 2 and all(0 <= float(b) < 1 for b in betas)):
        raise BigfitError(f"OffloadAdamW: betas {betas!r} are not valid; give two numbers in [0, 1), "
                          "e.g. (0.9, 0.999)")
    if eps is not None and not float(eps) >= 0:
        raise BigfitError(f"OffloadAdamW: eps {eps!r} is not valid; give a number >= 0, e.g. 1e-8")
    if wd is not None and not float(wd) >= 0:
        raise BigfitError(f"OffloadAdamW: weight_decay {wd!r} is not valid; give a number >= 0")


def check_settings(states: str, max_grad_norm: float) -> None:
    if states not in FORMATS:
        raise one_of("OffloadAdamW: states", states, FORMATS)
    if not max_grad_norm >= 0:
        raise BigfitError(f"OffloadAdamW: max_grad_norm {max_grad_norm!r} is not valid; give a norm > 0 to clip "
                          "by, or 0 for no clipping")


def check_single_process() -> None:
    """Data parallelism reduces gradients after OffloadAdamW's hooks have copied each rank's own."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise BigfitError(f"OffloadAdamW: torch.distributed runs {dist.get_world_size()} ranks, and OffloadAdamW "
                          "takes each gradient as backward makes it, before data parallelism reduces it; for "
                          f"several ranks use {WHOLE}")


def check_trainable(params: list) -> None:
    if not any(torch.is_tensor(p) and p.requires_grad for p in params):
        got = "an empty parameter list" if not params else f"{len(params)} parameters, none requiring grad"
        raise BigfitError(f"OffloadAdamW got {got}; pass the parameters to train (those with requires_grad=True)")

"""LoRA in the plan: the adapters injected into the traced model, and what frozen parameters save.

A frozen (base) parameter has no gradient, no optimizer state and no traffic of either: gradient
all-reduces and reduce-scatters, the offload engine's PCIe copies and host Adam move and step the
trainable parameters (LoRA's adapters) alone. Its matmul skips the weight gradient: 4 FLOPs a token
per parameter (forward 2, input gradient 2) against 6 for one that trains. Parameters themselves,
FSDP2's all-gathers of them and the activations (the trace records what autograd saves with the
base frozen) stay as they are. Pure, below profile.py and the row modules.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..adapters.lora import inject
from ..common.precision import DTYPES
from .quantized import STORED, transient

FROZEN_STATE = {"grads": 4, "optimizer": 8}  # fp32 bytes a frozen parameter does not have (AdamW: two moments)


def with_adapters(model: torch.nn.Module, settings, dtype: torch.dtype) -> torch.nn.Module:
    """`lora.inject` on a model built under FakeTensorMode, the adapters in `dtype`. peft moves each
    new adapter to its base layer's device and dtype with `Module.to`, which cannot swap a fake
    parameter; on the meta device it leaves them alone. So the adapters are made on meta outside the
    mode and become fake tensors here (shapes are all a trace needs). Their dropout is traced as the
    rest of the model's: on CUDA as its fused kernel (cudatrace.py's `cuda_kernels`; the CPU's would
    keep its noise in the input's dtype, fp32 where peft casts an adapter's input to fp32 adapters
    under autocast: an 8B Llama's adapters at 4 x 2048 saved 30 GB more that way than the H200 held)."""
    with unset_fake_temporarily(), torch.device("meta"):
        inject(model, settings)
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                mod._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype),
                                                           requires_grad=p.requires_grad)
    return model


def frozen_counts(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> dict:
    """ModelProfile's frozen fields: the model's frozen parameters (tied ones once), each block's, and
    whether the output head's weight is frozen. Nothing frozen leaves them at their defaults."""
    frozen = {id(p): p.numel() for p in model.parameters() if not p.requires_grad}
    if not frozen:
        return {}
    per_block = [sum(p.numel() for p in blk.parameters() if not p.requires_grad) for blk in blocks]
    head = model.get_output_embeddings().weight
    return {"frozen_params": sum(frozen.values()), "block_frozen": per_block, "head_frozen": not head.requires_grad}


def flop_weight(params: float, frozen: float = 0) -> float:
    """Model FLOPs a token of `params` matmul parameters, `frozen` of them frozen: 6 each (forward,
    input gradient, weight gradient), 4 for a frozen one (no weight gradient)."""
    return 6.0 * (params - frozen) + 4.0 * frozen


def module_flop_weight(params) -> float:
    """flop_weight of these parameters, frozen as their requires_grad says."""
    return sum(flop_weight(p.numel(), 0 if p.requires_grad else p.numel()) for p in params)


def without_frozen(parts: dict, frozen: float, c: int = 4, quantized: float = 0) -> dict:
    """Bytes by kind (estimate.KEYS) of parameters counted as training (state_bytes: fp32, with
    autocast's copy in `c` bytes), less what `frozen` of them do not have: gradients and AdamW
    moments; under autocast (c < 4) the fp32 weight and the copy, as the frozen weight is stored in
    the compute dtype (parallel/apply.py store_frozen); `quantized` of them in NF4 instead."""
    if not frozen:
        return parts
    saved = {k: b * frozen for k, b in FROZEN_STATE.items()}
    if c < 4:
        saved.update(params=(4 - c) * frozen + (c - STORED) * quantized, buffers=c * frozen)
    return {k: v - saved.get(k, 0) for k, v in parts.items()}


def frozen_costs(cost, prof, job):
    """Costs counted with every parameter training (16 bytes) for a profile with frozen parameters:
    each block's and the main device's without what their frozen parameters do not keep, the LoRA
    base layers in NF4 under --load-in-4bit, and one layer's dequantisation temporaries on every
    device beside a checkpointed block's recompute. planning/automap.py's profile_costs applies it,
    so every caller of that gets the LoRA bytes once."""
    if not prof.frozen_params:
        return cost
    c = DTYPES[job.precision].itemsize
    quantized = prof.block_quantized if job.load_in_4bit and prof.block_quantized else [0] * len(cost.parts)
    parts = [without_frozen(p, f, c, q) for p, f, q in zip(cost.parts, prof.blocks_frozen(), quantized)]
    extra = transient(prof, "torchao") if job.load_in_4bit else 0  # the larger of the two stores'
    return replace(cost, parts=parts, main_parts=without_frozen(cost.main_parts, prof.root_frozen, c),
                   per_device=cost.per_device + extra)


def outside_frozen_share(prof) -> float:
    """The frozen fraction of the parameters outside the blocks, for each of them (pipeline holders:
    embeddings, norms, head): all of them under LoRA's all-linear, none without LoRA."""
    return prof.root_frozen / prof.root_params if prof.frozen_params and prof.root_params else 0.0


def scaled_frozen(prof, blocks: list[float], params: float) -> dict:
    """The frozen fields of a part of the model (composed.share: one TP rank's `blocks` and `params`),
    each in proportion to what the part keeps of it: TP splits base weights and adapters alike."""
    if not prof.frozen_params:
        return {}
    block_frozen = [f * b / max(1, n) for f, b, n in zip(prof.block_frozen, blocks, prof.block_params)]
    root = params - sum(blocks)
    return {"frozen_params": sum(block_frozen) + prof.root_frozen * root / max(1, prof.root_params),
            "block_frozen": block_frozen}


def describe(settings, params: int, trainable: int) -> str:
    """The plan's line for a LoRA job: what trains, of how much."""
    return (f"LoRA r {settings.r} on {settings.targets}: {trainable / 1e6:.2f}M trainable parameters of "
            f"{params / 1e6:.1f}M ({trainable / max(1, params):.2%}); the base frozen (no gradients, "
            "no optimizer states)")

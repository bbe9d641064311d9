"""QLoRA's base: the frozen linear layers of a LoRA run stored in 4 bits (bitsandbytes NF4 with
double quantisation, computed in bf16), as `BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)` gives peft users.

transformers quantizes inside `from_pretrained`, on a whole model in host RAM. bigfit builds on the
meta device and fills each rank's tensors itself (loading/), so it quantizes there instead: each
LoRA-wrapped layer's `base_layer` (an nn.Linear on the meta device) becomes a bnb Linear4bit whose
weight is read (from the safetensors slices or the seeded init, one block's worth at a time) in
bf16 on the GPU and quantized at once. No process holds the base in more than 4 bits beyond one
layer's bf16 temporary: a 70B base takes ~35 GB. peft's LoRA layer calls its base_layer whatever
it is, so the adapters train on top unchanged. Frozen 4-bit weights stay out of checkpoints: a
resume builds and quantizes the base again from the same source, bit for bit.
"""
from __future__ import annotations

import torch

from .errors import BigfitError

QUANT = dict(quant_type="nf4", compress_statistics=True)  # NF4, double quantisation (QLoRA's)


def bnb():
    try:
        import bitsandbytes
    except ImportError:
        raise BigfitError("--load-in-4bit needs the bitsandbytes library: pip install 'bigfit[qlora]'") from None
    return bitsandbytes


def check(cfg, cuda: bool) -> None:
    """One line for each setting QLoRA cannot run with, before any work."""
    if not cfg.load_in_4bit:
        return
    if not cfg.lora:
        raise BigfitError("--load-in-4bit quantizes a frozen base under LoRA adapters (QLoRA): add --lora")
    if cfg.strategy not in ("single", "ddp", "auto"):  # auto: the planner rates single and ddp alone then
        raise BigfitError(f"--load-in-4bit runs with --strategy single, ddp or auto (each process holds the whole "
                          f"4-bit base), not {cfg.strategy}: 4-bit weights cannot be sharded or offloaded")
    if cfg.precision not in ("bf16", None):
        raise BigfitError(f"--load-in-4bit computes in bf16: use --precision bf16, not {cfg.precision}")
    if not cuda:
        raise BigfitError("--load-in-4bit needs a CUDA GPU (bitsandbytes' 4-bit kernels); this machine has none: "
                          "train the adapters on a bf16 base with --lora alone")
    bnb()


def quantized_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(path of the layer's weight, its parent, attribute) of each frozen nn.Linear that LoRA wraps:
    every base_layer (the head and embeddings, which carry no adapter, stay in bf16)."""
    out = []
    for path, mod in model.named_modules():
        base = mod._modules.get("base_layer")
        if type(base) is torch.nn.Linear and not base.weight.requires_grad:
            out.append((f"{path}.base_layer.weight", mod, "base_layer"))
    return out


@torch.no_grad()
def quantize_base(model: torch.nn.Module, weights, device) -> int:
    """Every LoRA base layer as a 4-bit Linear4bit on `device`, its weight read from `weights`
    (loading.Weights) in bf16 and quantized there; biases in bf16. Returns the layers quantized."""
    nn = bnb().nn
    layers = sorted(quantized_layers(model), key=lambda x: weights.order(x[0]))  # each init unit made once
    for name, parent, attr in layers:
        old = parent._modules[attr]
        new = nn.Linear4bit(old.in_features, old.out_features, bias=old.bias is not None,
                            compute_dtype=torch.bfloat16, device="meta", **QUANT)
        value = weights.read(name, None, torch.bfloat16, device)
        new.weight = nn.Params4bit(value, requires_grad=False, **QUANT).to(device)  # quantized on the move
        if old.bias is not None:
            bias = weights.read(name[: -len("weight")] + "bias", None, torch.bfloat16, device)
            new.bias = torch.nn.Parameter(bias, requires_grad=False)
        parent._modules[attr] = new
    return len(layers)


def is_quantized(t: torch.Tensor) -> bool:
    return type(t).__name__ == "Params4bit"

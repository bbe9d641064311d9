"""QLoRA's base: the frozen linear layers of a LoRA run stored in 4 bits (NF4 with double
quantisation, computed in bf16), as `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True)` gives peft users.

Two stores of the same format (blocks of 64 weights, an 8-bit absmax per block, an fp32 or bf16
factor per 256 absmaxes):
- bitsandbytes' Linear4bit for whole layers on a CUDA GPU (single, ddp, zero1, the offload engine's
  zero2-offload, a device map's GPUs, pipeline stages): its fused dequantisation kernels, the path
  measured on the H200.
- torchao's NF4Tensor where FSDP2 shards the base (zero2, zero3, zero3-offload) and for layers on
  the host (a device map's overflow, machines without CUDA). FSDP2 cannot shard bitsandbytes'
  packed parameter (its quantisation state is not a tensor it can split); NF4Tensor implements
  FSDP2's all-gather extension, so each rank stores a slice of every layer's 4-bit bytes and the
  all-gather moves 4 bits a weight, as torchtune does.

transformers quantizes inside `from_pretrained`, on a whole model in host RAM. bigfit builds on the
meta device and fills each rank's tensors itself (loading/), so it quantizes there instead: each
LoRA base layer's weight is read (from the safetensors slices or the seeded init) in bf16 on the
device and quantized at once: the whole base up front where each process holds all of it, each
layer on the device a device map places it on before the rest gets storage, a pipeline rank's own
stages' layers once it has dropped the others, one FSDP2 unit at a time just before it is sharded
(`UnitQuantizer`), so no device holds more than one unit's whole 4-bit layers beyond its shards.
peft's LoRA layer calls its base_layer whatever it is, so the adapters train on top unchanged; the
optimizers, DDP and the offload engine see only the adapters. Frozen 4-bit weights stay out of
checkpoints: a resume builds and quantizes the base again from the same source, bit for bit.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..errors import BigfitError

QUANT = dict(quant_type="nf4", compress_statistics=True)  # NF4, double quantisation (QLoRA's)
BLOCK, SCALER_BLOCK = 64, 256  # weights an absmax covers, absmaxes a factor covers (both stores)
SHARDED = ("zero2", "zero3", "zero3-offload")  # FSDP2's strategies: torchao's NF4Tensor, sharded


def whole_store(cuda: bool) -> str:
    """The library that stores a whole 4-bit layer: bitsandbytes on a CUDA GPU, torchao elsewhere."""
    return "bitsandbytes" if cuda else "torchao"


def backend(strategy: str, cuda: bool) -> str:
    """Which library stores the 4-bit layers of `strategy` (module docstring): `cuda`, whether they
    live on a CUDA GPU; FSDP2's shards are torchao's wherever they are."""
    return "torchao" if strategy in SHARDED else whole_store(cuda)


def bnb():
    try:
        import bitsandbytes
    except ImportError:
        raise BigfitError("--load-in-4bit needs the bitsandbytes library: pip install 'bigfit[qlora]'") from None
    return bitsandbytes


def nf4():
    """torchao's NF4Tensor and quantizer (the module moved between releases; bigfit/__init__.py quiets
    its import's warnings about CUDA kernels it does not need)."""
    try:
        from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
    except ImportError:
        try:
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
        except ImportError:
            raise BigfitError("--load-in-4bit with a sharded base or layers on the host needs the torchao library: "
                              "pip install 'bigfit[qlora]'") from None
    from .nf4 import install

    install(NF4Tensor)  # FSDP2's gather as one byte tensor, a leaner dequantisation (nf4.py)
    return NF4Tensor, to_nf4


def check(cfg, cuda: bool, libraries: bool = True) -> None:
    """One line for each setting QLoRA cannot run with, before any work; with `libraries`, also for
    the library the run's store needs when it is missing (a plan needs neither)."""
    if not cfg.load_in_4bit:
        return
    if not cfg.lora:
        raise BigfitError("--load-in-4bit quantizes a frozen base under LoRA adapters (QLoRA): add --lora")
    # a pipeline's stages hold whole layers, and may have data-parallel replicas; nothing else splits them
    allowed = ("pp", "dp_replicate") if cfg.strategy == "pipeline" else ()
    split = {f"--{k.replace('_', '-')}": getattr(cfg, k, None) for k in ("tp", "pp", "dp_replicate") if k not in allowed}
    split = {k: v for k, v in split.items() if v not in (None, 1)}
    if split:
        k, v = next(iter(split.items()))
        raise BigfitError(f"--load-in-4bit with {k} {v}: a 4-bit base is split by FSDP2 (zero2, zero3, zero3-offload "
                          f"over data-parallel ranks) or into whole layers (device_map, pipeline) alone; drop {k}")
    if cfg.precision not in ("bf16", None):
        raise BigfitError(f"--load-in-4bit computes in bf16: use --precision bf16, not {cfg.precision}")
    if libraries:
        bnb() if backend(cfg.strategy, cuda) == "bitsandbytes" else nf4()
        if cuda and cfg.strategy == "device_map":  # its layers on the host, if any, are torchao's
            nf4()


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
def quantize_base(model: torch.nn.Module, weights, device_of, cuda: bool | None = None) -> dict[str, int]:
    """Every LoRA base layer in 4 bits on its device (`device_of(weight's name)`), its weight read
    from `weights` (loading.Weights) in bf16 and quantized there, by the store for that device
    (`backend`: whether it is a CUDA GPU, or `cuda` for all). Returns the layers quantized by each store."""
    layers = sorted(quantized_layers(model), key=lambda x: weights.order(x[0]))  # each init unit made once
    places = {name: torch.device(device_of(name)) for name, _, _ in layers}
    stores = {name: whole_store(d.type == "cuda" if cuda is None else cuda) for name, d in places.items()}
    check_blocks(model, 1, {name for name, store in stores.items() if store == "torchao"})
    for name, parent, attr in layers:
        (_bnb_layer if stores[name] == "bitsandbytes" else _nf4_layer)(name, parent, attr, weights, places[name])
    return {store: sum(s == store for s in stores.values()) for store in sorted(set(stores.values()))}


def describe(stores: dict[str, int], of: str = "") -> str:
    """The run's line for its 4-bit base: how many layers (`of` what: " of rank 0's stages"), in which store."""
    where = next(iter(stores)) if len(stores) == 1 else ", ".join(f"{n} in {k}" for k, n in stores.items())
    return f"QLoRA: {sum(stores.values())} base layers{of} in 4 bits (NF4, double quantisation; {where})"


def _bnb_layer(name, parent, attr, weights, device) -> None:
    """bitsandbytes' Linear4bit in place of the layer; its bias read in bf16."""
    nn, old = bnb().nn, parent._modules[attr]
    new = nn.Linear4bit(old.in_features, old.out_features, bias=old.bias is not None,
                        compute_dtype=torch.bfloat16, device="meta", **QUANT)
    value = weights.read(name, None, torch.bfloat16, device)
    new.weight = nn.Params4bit(value, requires_grad=False, **QUANT).to(device)  # quantized on the move
    if old.bias is not None:
        bias = weights.read(name[: -len("weight")] + "bias", None, torch.bfloat16, device)
        new.bias = torch.nn.Parameter(bias, requires_grad=False)
    parent._modules[attr] = new


def _nf4_layer(name, parent, attr, weights, device) -> None:
    """The layer keeps its class; its weight becomes an NF4Tensor, which F.linear dequantizes (torchao
    dispatches it). Its bias stays a frozen parameter, filled with the rest (loading.fill)."""
    _, to_nf4 = nf4()
    layer = parent._modules[attr]
    value = weights.read(name, None, torch.bfloat16, device)
    layer.weight = torch.nn.Parameter(to_nf4(value, BLOCK, SCALER_BLOCK), requires_grad=False)


def check_blocks(model: torch.nn.Module, ranks: int, names=None) -> None:
    """torchao's NF4 of a layer, and FSDP2's share of it on each of `ranks`, holds whole blocks and
    factors: every base layer's size (or those of `names`) a multiple of 64 x 256 x ranks, its rows
    of ranks (any real model's linear layers are; tests/tiny.py's are not)."""
    multiple = BLOCK * SCALER_BLOCK * ranks
    for name, parent, attr in quantized_layers(model):
        if names is not None and name not in names:
            continue
        w = parent._modules[attr].weight
        if w.numel() % multiple or w.shape[0] % ranks:
            share, fewer = (f"{multiple} weights a rank's share, rows a multiple of {ranks}", ", or fewer ranks") \
                if ranks > 1 else (f"a multiple of {multiple} weights", "")
            raise BigfitError(f"--load-in-4bit: {name} {list(w.shape)} does not split into whole NF4 blocks "
                              f"({share}); use a model whose linear layers do{fewer}")


class UnitQuantizer:
    """FSDP2's hook before each unit is sharded (data_parallel/sharding.py `shard_units`): the LoRA base
    layers inside `unit` not yet quantized, as NF4Tensors on `device`; FSDP2 then keeps this rank's
    rows of each and frees the rest."""

    def __init__(self, model: torch.nn.Module, weights, device, ranks: int):
        check_blocks(model, ranks)
        self.weights, self.device, self.done = weights, device, 0
        layers = sorted(quantized_layers(model), key=lambda x: weights.order(x[0]))
        self.pending = {id(parent._modules[attr]): (name, parent, attr) for name, parent, attr in layers}

    def __call__(self, unit: torch.nn.Module) -> None:
        for mod in unit.modules():
            found = self.pending.pop(id(mod), None)
            if found:
                _nf4_layer(*found, self.weights, self.device)
                self.done += 1


def is_quantized(t: torch.Tensor) -> bool:
    """A 4-bit weight of either store, a DTensor's shard of one included."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return type(local).__name__ in ("Params4bit", "NF4Tensor")

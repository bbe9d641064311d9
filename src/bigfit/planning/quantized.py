"""QLoRA's 4-bit base in the plan (`--lora --load-in-4bit`, adapters/quantize.py): the bytes of the LoRA base
layers' weights in NF4 with double quantisation, the bf16 copy each matmul dequantizes for itself,
and that dequantisation's memory traffic. Two libraries store the same format (adapters/quantize.py): where
each GPU holds whole layers (single, ddp, zero1, zero2-offload, a device map's GPUs, pipeline
stages), bitsandbytes' Linear4bit and its fused kernels; where FSDP2 shards it (zero2, zero3,
zero3-offload: each rank keeps its rows of every layer's blocks, the all-gathers move 4 bits a
weight) or there is no CUDA, torchao's NF4Tensor, which dequantizes in a chain of eager operators.
Everything else is LoRA's (adapters.py): the other frozen parameters in bf16 (store_frozen), the
adapters in fp32 with their gradients and AdamW's moments, the trace's activations (a 4-bit matmul,
like a frozen bf16 one, saves no input). Pure arithmetic on the trace's counts; nothing here imports
either library."""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ..adapters.quantize import SHARDED, backend, check as check_4bit, quantized_layers
from ..models.source import block_lists
from .devicecost import GATHER, MEM_EFFICIENCY

# the layout both libraries share (blocksize 64, double quantisation): two weights a byte; an absmax
# per block of 64 weights, itself stored in 8 bits with an fp32 factor per 256 blocks (torchao keeps
# that factor in the weight's bf16: 2 bytes less per 16,384 weights, left out)
BLOCK, BLOCK2 = 64, 256
STORED = 0.5 + 1 / BLOCK + 4 / (BLOCK * BLOCK2)  # 0.5159 bytes a weight
# per layer: NF4's 16-value code and the 8-bit absmaxes' offset, each in the CUDA allocator's
# smallest block (512 bytes), and those absmaxes' 256-value fp32 code (quantize_blockwise copies it);
# torchao's code and mean take two such blocks on every rank, counted the same
LAYER_BYTES = 2 * 512 + 4 * 256
FP32_ABSMAX = 4 / BLOCK  # the absmaxes made fp32 again for each dequantisation, a weight's share
# One dequantisation, in bytes a weight (bitsandbytes 0.50's backends/cuda/ops.py, its path for a
# matmul over more than 1,536 tokens; fewer may take a fused kernel that writes no copy, counted the
# same): the 8-bit absmaxes read, written in fp32, read and written again to add their offset; then
# the packed weight and those absmaxes read and the bf16 copy written. The matmul's read of that copy
# is a bf16 base's read too, inside its FLOP time.
DEQUANT_BYTES = 1 / BLOCK + 3 * FP32_ABSMAX + 0.5 + FP32_ABSMAX + 2  # 2.77
# alive while one layer computes: its bf16 copy, and its absmaxes in fp32 (before and after the offset)
TRANSIENT_BYTES = 2 + 2 * FP32_ABSMAX
# The dequantisation of torchao's NF4Tensor (bigfit's, adapters/nf4.py: torchao's own moves 33 and holds 14),
# which F.linear calls on the weight in forward and in backward, in bytes a weight (read off its
# operators on this CPU, tests/test_planning_quantized.py): the packed bytes made int32 indices (0.5
# read, 2 written), each byte's two code values looked up (2, 2), scaled by the block's bf16 absmax
# into the copy (2 + 2 / BLOCK, 2); the absmaxes made bf16 and offset (7 / BLOCK). At once: the
# indices and the looked-up values, or those values and the copy.
TORCHAO_DEQUANT_BYTES = (0.5 + 2) + (2 + 2) + (2 + 2 / BLOCK + 2) + 7 / BLOCK  # 10.64
TORCHAO_TRANSIENT_BYTES = 2 + 2 + 2 / BLOCK  # 4.03


def base_counts(model: torch.nn.Module) -> dict:
    """ModelProfile's quantized fields: the weights `--load-in-4bit` stores in 4 bits (every LoRA
    base layer's: quantize.quantized_layers, what training quantizes), how many layers, the largest,
    those in the largest block and in each, and the rank counts FSDP2 can split them over."""
    weights = [getattr(parent, attr).weight for _, parent, attr in quantized_layers(model)]
    if not weights:
        return {}
    sizes = {id(w): w.numel() for w in weights}
    blocks = [blk for _, stack in block_lists(model) for blk in stack]
    largest = max(blocks, key=lambda b: sum(p.numel() for p in b.parameters()), default=None)
    unit = sum(sizes.get(id(p), 0) for p in largest.parameters()) if largest is not None else 0
    # quantize.check_blocks: a rank's rows of a layer hold whole blocks and whole factors' groups
    whole = math.gcd(*sizes.values())
    ranks = math.gcd(whole // (BLOCK * BLOCK2), *(w.shape[0] for w in weights)) if whole % (BLOCK * BLOCK2) == 0 else 0
    return {"quantized_params": sum(sizes.values()), "quantized_layers": len(sizes),
            "largest_quantized": max(sizes.values()), "unit_quantized": unit, "nf4_ranks": ranks,
            "block_quantized": [sum(sizes.get(id(p), 0) for p in blk.parameters()) for blk in blocks]}


def store(strategy: str, hw) -> str:
    """The library that holds the base on this row (quantize.backend): torchao where FSDP2 shards it
    or the devices are not CUDA GPUs, bitsandbytes otherwise."""
    return backend(strategy, hw.device == "cuda")


def unrunnable(prof, strategy: str, hw) -> str | None:
    """Why training would refuse this row's 4-bit base (quantize.check_blocks), or None: torchao's
    layers must split into whole blocks over the ranks that shard them (any real model's do)."""
    if store(strategy, hw) != "torchao":
        return None
    ranks = hw.world_size if strategy in SHARDED else 1
    if prof.nf4_ranks and prof.nf4_ranks % ranks == 0:
        return None
    return (f"cannot store its base layers in torchao's NF4 over {ranks} rank(s): each rank's rows must hold whole "
            f"blocks of {BLOCK} x {BLOCK2} weights")


def frozen_bytes(prof, c: int) -> float:
    """The frozen parameters' bytes with the base layers in 4 bits, where each process holds all of
    them: those weights in NF4, every other frozen parameter (embeddings, norms, the head) in the
    compute dtype."""
    q = prof.quantized_params
    return STORED * q + LAYER_BYTES * prof.quantized_layers + c * (prof.frozen_params - q)


def shard_bytes(prof, w: int) -> float:
    """A rank's share of the base under FSDP2: its rows of every layer's blocks, and each layer's small
    tensors whole."""
    return STORED * prof.quantized_params / w + LAYER_BYTES * prof.quantized_layers


def with_base(c: float, params: float, quantized: float) -> float:
    """The bytes of `params` parameters at `c` bytes each, `quantized` of them in NF4 instead: what an
    all-gather moves and leaves unsharded (FSDP2 gathers an NF4Tensor's own bytes, torchao's
    fsdp_pre_all_gather), or a shard's bytes with c = 4."""
    return c * (params - quantized) + STORED * quantized


def transient(prof, library: str = "bitsandbytes") -> float:
    """One layer's dequantisation temporaries, the largest layer's: alive in forward and backward."""
    per_weight = TORCHAO_TRANSIENT_BYTES if library == "torchao" else TRANSIENT_BYTES
    return per_weight * prof.largest_quantized


def dequant_seconds(prof, hw, job, micro_batches: int, library: str = "bitsandbytes", params=None) -> float:
    """The GPU's seconds a step of dequantising the base (or `params` of its weights: a device's or a
    stage's): every 4-bit matmul dequantizes its weight in forward, again in backward for its input
    gradient (and in the recompute with checkpointing), once per micro-batch (or chunk) whatever its
    size, at the memory-bound rate of devicecost.py's other operators. Under FSDP2 each rank
    dequantizes every layer, as it computes with every gathered unit."""
    passes = 3 if job.checkpointing else 2
    per_weight = TORCHAO_DEQUANT_BYTES if library == "torchao" else DEQUANT_BYTES
    moved = micro_batches * passes * per_weight * (prof.quantized_params if params is None else params)
    return moved / (hw.gpu_mem_gbps * 1e9 * MEM_EFFICIENCY)


def gather_saving(prof, hw, micro_batches: int, gathers: int) -> float:
    """The GPU's seconds FSDP2's copies around its all-gathers (devicecost.GATHER, 4 bytes a bf16
    parameter) spare a step where the gathered weights are NF4: FSDP2's copy-out and adapters/nf4.py's
    copy into the layer's own tensors each read and write a weight's 0.516 bytes."""
    spared = micro_batches * gathers * (GATHER - 4 * STORED) * prof.quantized_params
    return spared / (hw.gpu_mem_gbps * 1e9 * MEM_EFFICIENCY)


def check(lora: bool, precision: str, degrees: dict | None = None) -> None:
    """`bigfit plan --load-in-4bit`: `bigfit train`'s one-line refusals (quantize.check), less the
    libraries': a plan imports neither bitsandbytes nor torchao. A plan takes no --strategy; composed
    plans' degrees (`degrees`, --tp 2) are refused as that strategy would be."""
    strategy = "zero3" if degrees else "single"  # degrees: an FSDP2 layout, refused for its --tp, --pp, ...
    view = SimpleNamespace(load_in_4bit=True, lora=lora, strategy=strategy, precision=precision, **(degrees or {}))
    check_4bit(view, cuda=False, libraries=False)


def describe(prof) -> str:
    """The plan's line for a 4-bit base: what is quantized, its bytes against bf16's, the rows rated."""
    q = prof.quantized_params
    return (f"4-bit base (QLoRA): {prof.quantized_layers} LoRA base layers, {q / 1e9:.2f}B parameters in NF4 "
            f"with double quantisation, {STORED * q / 1e9:.1f} GB ({2 * q / 1e9:.1f} GB in bf16), each dequantized "
            "to bf16 in forward and backward; bitsandbytes holds whole layers on each GPU (single, ddp, zero1, "
            "zero2-offload, device_map, pipeline), torchao's NF4Tensor is sharded by FSDP2 (zero2, zero3, "
            "zero3-offload: offloaded with it); no composed layout")

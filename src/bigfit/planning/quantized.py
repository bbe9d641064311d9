"""QLoRA's 4-bit base in the plan (`--lora --load-in-4bit`, quantize.py): the bytes of the LoRA base
layers' weights in bitsandbytes' NF4 with double quantisation, the bf16 copy each matmul dequantizes
for itself, and that dequantisation's memory traffic. Everything else is LoRA's (adapters.py): the
other frozen parameters in bf16 (parallel/apply.py store_frozen), the adapters in fp32 with their
gradients and AdamW's moments, the trace's activations (a 4-bit matmul, like a frozen bf16 one,
saves no input). Only single and ddp run it (each process holds the whole 4-bit base), so only
they are rated. Pure arithmetic on the trace's counts; nothing here imports bitsandbytes."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..errors import BigfitError
from ..quantize import check as check_4bit, quantized_layers
from .devicecost import MEM_EFFICIENCY

STRATEGIES = ("single", "ddp")  # quantize.check's: 4-bit weights are neither sharded nor offloaded
# bitsandbytes' layout (functional.quantize_4bit, blocksize 64, compress_statistics): two weights a
# byte; an absmax per block of 64 weights, itself stored in 8 bits with an fp32 absmax per 256 blocks
BLOCK, BLOCK2 = 64, 256
STORED = 0.5 + 1 / BLOCK + 4 / (BLOCK * BLOCK2)  # 0.5159 bytes a weight
# per layer: NF4's 16-value code and the 8-bit absmaxes' offset, each in the CUDA allocator's
# smallest block (512 bytes), and those absmaxes' 256-value fp32 code (quantize_blockwise copies it)
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


def base_counts(model: torch.nn.Module) -> dict:
    """ModelProfile's quantized fields: the weights `--load-in-4bit` stores in 4 bits (every LoRA
    base layer's: quantize.quantized_layers, what training quantizes), how many layers, the largest."""
    sizes = [getattr(parent, attr).weight.numel() for _, parent, attr in quantized_layers(model)]
    if not sizes:
        return {}
    return {"quantized_params": sum(sizes), "quantized_layers": len(sizes), "largest_quantized": max(sizes)}


def frozen_bytes(prof, c: int) -> float:
    """The frozen parameters' bytes with the base layers in 4 bits: those weights as bitsandbytes
    stores them, every other frozen parameter (embeddings, norms, the head) in the compute dtype."""
    q = prof.quantized_params
    return STORED * q + LAYER_BYTES * prof.quantized_layers + c * (prof.frozen_params - q)


def transient(prof) -> float:
    """One layer's dequantisation temporaries, the largest layer's: alive in forward and backward."""
    return TRANSIENT_BYTES * prof.largest_quantized


def dequant_seconds(prof, hw, job, micro_batches: int) -> float:
    """The GPU's seconds a step of dequantising the base: every 4-bit matmul dequantizes its weight in
    forward, again in backward for its input gradient (and in the recompute with checkpointing), once
    per micro-batch whatever its size, at the memory-bound rate of devicecost.py's other operators."""
    passes = 3 if job.checkpointing else 2
    moved = micro_batches * passes * DEQUANT_BYTES * prof.quantized_params
    return moved / (hw.gpu_mem_gbps * 1e9 * MEM_EFFICIENCY)


def rated(strategies, job) -> tuple[str, ...]:
    """The strategies a job with a 4-bit base is rated with: single and ddp among those asked for."""
    return tuple(s for s in strategies if s in STRATEGIES) if job.load_in_4bit else tuple(strategies)


def check(lora: bool, precision: str, degrees: dict | None = None) -> None:
    """`bigfit plan --load-in-4bit`: `bigfit train`'s one-line refusals (quantize.check), less the
    machine's: a plan needs neither a CUDA GPU nor bitsandbytes. A plan takes no --strategy; composed
    plans' degrees (`degrees`, --tp 2) are refused as a strategy other than single and ddp would be."""
    strategy = " ".join(f"--{d.replace('_', '-')} {v}" for d, v in (degrees or {}).items()) or "single"
    view = SimpleNamespace(load_in_4bit=True, lora=lora, strategy=strategy, precision=precision)
    try:
        check_4bit(view, cuda=False)
    except BigfitError as e:
        if str(e) != _machine_line():
            raise


def _machine_line() -> str | None:
    """quantize.check's refusal of a machine without CUDA, which it makes after the settings' and
    before it imports bitsandbytes: valid settings end there, so that line is a pass for a plan."""
    try:
        check_4bit(SimpleNamespace(load_in_4bit=True, lora=True, strategy="single", precision="bf16"), cuda=False)
    except BigfitError as e:
        return str(e)
    return None


def describe(prof) -> str:
    """The plan's line for a 4-bit base: what is quantized, its bytes against bf16's, the rows rated."""
    q = prof.quantized_params
    return (f"4-bit base (QLoRA): {prof.quantized_layers} LoRA base layers, {q / 1e9:.2f}B parameters in NF4 "
            f"with double quantisation, {STORED * q / 1e9:.1f} GB ({2 * q / 1e9:.1f} GB in bf16), each dequantized "
            f"to bf16 in forward and backward; rated with {' and '.join(STRATEGIES)} alone (the 4-bit base is "
            "neither sharded nor offloaded)")

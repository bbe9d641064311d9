"""The GPU's own time for a step's work, in two parts that do not overlap within an operator stream:
the matmuls' and attention's FLOPs at MFU of the peak, and the bytes every other operator reads and
writes (norms, activations, dropout, residual adds, casts: the trace's `block_traffic`) at the
memory's effective bandwidth. FLOPs alone rated T5-large at batch 128 (fp32 norms, a residual stream
in fp32 under autocast, its d_model of 1024) 57% too fast on the H200, where a Llama of the same FLOPs
fit; the bytes per FLOP tell them apart (profile.py's traffic: T5-large 2.2 GB per TFLOP, an 8B Llama
0.5). Pure arithmetic on the trace and the machine's description."""
from __future__ import annotations

from collections.abc import Iterable

# Fraction of the dense bf16 peak the matmuls and attention reach, and fraction of the memory's
# bandwidth the other operators reach, fitted together to the H200 rows whose time is the GPU's
# (tests/data/h200_measured.json: single, ddp, zero2 and zero3 from 1.5B to 8B Llamas, GPT-2, T5-large
# at batch 64 and 128; benchmarks/plan_vs_measured.py rates them).
MFU = 0.6
MEM_EFFICIENCY = 0.7
# The forward's bytes once, the backward's about twice: each operator's gradient reads the incoming
# gradient and what it saved, and writes a gradient for each input.
PASSES = 3
# What torch.compile (inductor) leaves of eager's traffic: it fuses the elementwise chains of a block
# into a few kernels that read each input once (T5-large at batch 128 on the H200 machine: eager 0.58 s,
# compiled 0.31 s, about the matmuls' time alone).
COMPILED = 0.2
# fp32 matmuls (no tensor cores; torch leaves TF32 off) against the dense bf16 peak: 67 / 989 TFLOP/s on
# the H100 and H200, 19.5 / 312 on the A100. The trace's `block_fp32_flops` run at this share of the peak.
FP32_SHARE = 1 / 15


def traffic_seconds(prof, hw, job, blocks: Iterable[int], outside: bool, samples: float) -> float:
    """Seconds of memory-bound work for `samples` samples through `blocks` (indices into the profile's
    blocks), forward and backward (its recompute too, with checkpointing), and the parts outside the
    blocks (embeddings, head, loss) when `outside`. A profile without traffic (built by hand): none."""
    if not prof.block_traffic:
        return 0.0
    traced = prof.tokens / max(1, job.seq_len + job.target_len)  # the samples of the traced micro-batch
    moved = sum(prof.block_traffic[g] for g in blocks) * (COMPILED if job.compile else 1.0)
    moved *= (PASSES + 1) / PASSES if job.checkpointing else 1.0
    moved += prof.other_traffic if outside else 0
    memory = moved / (hw.gpu_mem_gbps * 1e9 * MEM_EFFICIENCY)
    return PASSES * (memory + _fp32_seconds(prof, hw, job, blocks)) * samples / traced


def _fp32_seconds(prof, hw, job, blocks: Iterable[int]) -> float:
    """What the traced micro-batch's fp32 matmuls (forward) take beyond their FLOPs at the bf16 rate,
    which flops_per_token already counts them at. Inductor fuses T5's math-path attention too, but
    not onto tensor cores: compiled, the same."""
    flops = sum(prof.block_fp32_flops[g] for g in blocks) if prof.block_fp32_flops else 0
    flops *= (PASSES + 1) / PASSES if job.checkpointing else 1.0
    return flops * (1 / FP32_SHARE - 1) / (hw.gpu_tflops * 1e12 * MFU)


def step_traffic(prof, hw, job, samples_per_rank: float) -> float:
    """The whole model's memory-bound seconds for one rank's samples of a step."""
    return traffic_seconds(prof, hw, job, range(prof.n_blocks), True, samples_per_rank)

"""The GPU's own time for a step's work, in two parts that do not overlap within an operator stream:
the matmuls' and attention's FLOPs at MFU of the peak, and the bytes every other operator reads and
writes (norms, activations, dropout, residual adds, casts: the trace's `block_traffic`) at the
memory's effective bandwidth. FLOPs alone rated T5-large at batch 128 (fp32 norms, a residual stream
in fp32 under autocast, its d_model of 1024) 57% too fast on the H200, where a Llama of the same FLOPs
fit; the bytes per FLOP tell them apart (profile.py's traffic: T5-large 2.2 GB per TFLOP, an 8B Llama
0.5). Pure arithmetic on the trace and the machine's description."""
from __future__ import annotations

from collections.abc import Iterable

# Fraction of Hardware.gpu_tflops the matmuls and attention reach, and fraction of the memory's
# bandwidth the other operators reach. The H200's profiler (2026-12-03, 3.6B and 8B Llamas at 4 x 2048,
# full and LoRA, benchmarks/results/2026-12-03-h200-lora-kernels/): matmul kernels at 0.91-1.01 of 760
# TFLOP/s; the rest at 0.55-0.6 of 4.8 TB/s for full fine-tunes, 0.8 for LoRA's. Then fitted on every
# H200 row whose time is the GPU's (tests/data/h200_measured.json; benchmarks/plan_vs_measured.py),
# with the optimizer's and autocast's parameter traffic below, which 0.6 and 0.7 had stood in for.
MFU = 0.9
MEM_EFFICIENCY = 0.55
# LoRA's memory-bound kernels, as the same profile read them: peft's adapter matmuls' neighbours (the
# dropout, the scaling, the sum into the base layer's output) and a frozen base's backward, which
# computes no weight gradient, stream nearer the bandwidth than a full fine-tune's mix.
LORA_MEM_EFFICIENCY = 0.8
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


def matmul_flops_per_s(hw, precision: str) -> float:
    """The FLOP/s a job's matmuls reach: MFU of the GPU's dense bf16 peak, FP32_SHARE of that where the
    job computes in fp32 (measured: single fp32 on the H200 at T5-large's 247 x 128/128, 3.25 s a step
    against 0.87 s in bf16 at 271). A machine without GPUs: its rates are its fp32 ones already."""
    rate = hw.gpu_tflops * 1e12 * MFU
    return rate * FP32_SHARE if precision == "fp32" and hw.device == "cuda" else rate


def traffic_seconds(prof, hw, job, blocks: Iterable[int], outside: bool, samples: float) -> float:
    """Seconds of memory-bound work for `samples` samples through `blocks` (indices into the profile's
    blocks), forward and backward (its recompute too, with checkpointing), and the parts outside the
    blocks (embeddings, head, loss) when `outside`. A profile without traffic (built by hand): none."""
    if not prof.block_traffic:
        return 0.0
    traced = prof.tokens / max(1, job.seq_len + job.target_len)  # the samples of the traced micro-batch
    blocks = list(blocks)
    moved = sum(prof.block_traffic[g] for g in blocks) * (COMPILED if job.compile else 1.0)
    moved *= _recomputed(prof, job, blocks, prof.block_traffic)
    moved += prof.other_traffic if outside else 0
    memory = moved / (hw.gpu_mem_gbps * 1e9 * (LORA_MEM_EFFICIENCY if job.lora else MEM_EFFICIENCY))
    return PASSES * (memory + _fp32_seconds(prof, hw, job, blocks)) * samples / traced


def _fp32_seconds(prof, hw, job, blocks: Iterable[int]) -> float:
    """What the traced micro-batch's fp32 matmuls (forward) take beyond their FLOPs at the bf16 rate,
    which flops_per_token already counts them at. Inductor fuses T5's math-path attention too, but
    not onto tensor cores: compiled, the same."""
    flops = sum(prof.block_fp32_flops[g] for g in blocks) if prof.block_fp32_flops else 0
    flops *= _recomputed(prof, job, blocks, prof.block_fp32_flops) if flops else 1.0
    return flops * (1 / FP32_SHARE - 1) / (hw.gpu_tflops * 1e12 * MFU)


def _recomputed(prof, job, blocks: list[int], per_block: list) -> float:
    """The factor on `blocks`' forward-and-backward work (PASSES) of the checkpointed ones' forward
    running again: (PASSES + 1) / PASSES where all are, a share of it where only some are."""
    again = job.checkpointed(prof.stacks, prof.n_blocks)
    if all(again[g] for g in blocks):
        return (PASSES + 1) / PASSES if job.checkpointing else 1.0
    whole = sum(per_block[g] for g in blocks)
    return 1.0 + sum(per_block[g] for g in blocks if again[g]) / PASSES / whole if whole else 1.0


def step_traffic(prof, hw, job, samples_per_rank: float) -> float:
    """The whole model's memory-bound seconds for one rank's samples of a step."""
    return traffic_seconds(prof, hw, job, range(prof.n_blocks), True, samples_per_rank)


# Bytes a trainable parameter moves on the GPU once a step whatever the batch, outside the trace's
# forward: AdamW's fused step (reads the fp32 parameter, gradient and two moments, writes three), the
# gradient clipping's norm and scaling (reads, then reads and writes, the fp32 gradient).
ADAM = 28
CLIP = 12
# Under autocast, per micro-batch: each weight's bf16 copy (reads 4, writes 2) and its bf16 gradient
# added into the fp32 one (reads 2 and 4, writes 4). A frozen base (LoRA) is stored in bf16: no copy.
AUTOCAST = 16
# Under FSDP2, per micro-batch: each all-gather's copy-out of the bf16 parameters (reads and writes 2,
# every parameter, frozen ones too) and the gradients' copy into the reduce-scatter (trainable ones).
GATHER = 4
REDUCE = 6


def parameter_seconds(prof, hw, job, shards: int, accum: int, autocast: bool = False, gathers: int = 0) -> float:
    """The GPU's memory-bound seconds a step on its share of the parameters (`shards`: the ranks the
    optimizer's states are divided over; `gathers`: FSDP2's all-gathers per micro-batch, 0 without
    it): the fused AdamW step measured 30 ms for a 3.6B Llama on the H200 (2026-12-03, torch
    profiler), the 3.3 TB/s this model gives it."""
    t = prof.trainable_params
    moved = t * (ADAM + (CLIP if job.clipping else 0)) / shards + t * AUTOCAST * accum * autocast
    moved += (prof.params * GATHER * gathers + t * REDUCE * bool(gathers)) * accum
    return moved / (hw.gpu_mem_gbps * 1e9 * MEM_EFFICIENCY)


# What a model's operators reach of the CPU's measured rates (calibration.cpu_rates): on the 2-core
# machine (2026-12-05, torch's profiler over training steps of the embedded T5 at 64 and 512 samples of
# 24 + 8 tokens, on 1 and 2 threads) its matmuls, of inner dimension 128 and 256 beside attention's small
# batched ones, ran at 0.5-0.8 of a 1024-square matmul's rate, and its other operators at 0.5-0.9 of a
# copy's bandwidth. The measured rates are reached rates, not peaks, so these stand where MFU and
# MEM_EFFICIENCY stand on a GPU (above).
CPU_MATMUL_REACH = 0.7
CPU_COPY_REACH = 0.7


def cpu_device_rates(tflops: float, mem_gbps: float, world: int) -> dict:
    """Hardware's rate fields for `world` processes on a machine without GPUs, from its measured fp32
    matmul TFLOP/s and memory GB/s on all its cores (calibration.cpu_rates): each process computes on
    its share of the cores (commands/launch.py gives each cores // world threads), so on 1 / world of both rates
    (on 2 cores of 2026-12-05, 1 thread had 0.13 of 2 threads' 0.23 TFLOP/s and 12 of their 27 GB/s).
    The planner rates matmuls at MFU of gpu_tflops and the other operators at MEM_EFFICIENCY of
    gpu_mem_gbps, a GPU's shares of its peaks: here the fields are set so that those shares come to
    CPU_MATMUL_REACH and CPU_COPY_REACH of the measured rates. cpu_tflops: device_map's one process,
    its blocks all on the host (planning/device_map_row.py), on every core. (gloo's links: hardware.GLOO_LOCAL_GBPS.)"""
    return dict(gpu_tflops=tflops * CPU_MATMUL_REACH / MFU / world,
                gpu_mem_gbps=mem_gbps * CPU_COPY_REACH / MEM_EFFICIENCY / world,
                cpu_tflops=tflops * CPU_MATMUL_REACH)

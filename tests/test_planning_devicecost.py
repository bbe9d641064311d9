"""The GPU's memory-bound time in the planner's step times (planning/devicecost.py): the bytes the
trace's non-matmul operators read and write (profile.py's `block_traffic`), counted exactly on a
known operator, growing with the batch, lowered by compiling, and added to the FLOPs' time."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bigfit.machine.hardware import Hardware
from bigfit.planning.workload import Workload

GB = 10**9


def small_llama(layers: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000)


def test_traffic_counts_operator_bytes_but_not_matmuls_views_or_parameters():
    from bigfit.planning.opcount import OpCounter

    weight = torch.nn.Parameter(torch.ones(64, 32))
    counter = OpCounter([0], 1, {weight.untyped_storage()._cdata})
    x = torch.ones(8, 32)
    with counter:
        y = x @ weight.t()  # a matmul: its FLOPs count, not its bytes
        z = torch.relu(y).view(8, 8, 8)  # relu reads and writes 8 x 64 fp32; the view moves nothing
        w = z * weight[0, 0]  # reads z and a parameter's element (a view of the parameter), writes z's size
    assert counter.blocks == [3]
    assert counter.block_bytes == [2 * 8 * 64 * 4 + 2 * 8 * 64 * 4]
    assert w.shape == (8, 8, 8)


def test_traffic_grows_with_the_batch_and_the_step_pays_for_it():
    from bigfit.planning.devicecost import (ADAM, CLIP, COMPILED, GATHER, MEM_EFFICIENCY, REDUCE, parameter_seconds,
                                            traffic_seconds)
    from bigfit.planning.profile import profile_model
    from bigfit.planning.search import plan_for_config

    small = profile_model(small_llama(), 2, 64, 0, "bf16")
    large = profile_model(small_llama(), 8, 64, 0, "bf16")
    assert all(t > 0 for t in small.block_traffic) and small.other_traffic > 0
    assert sum(large.block_traffic) == pytest.approx(4 * sum(small.block_traffic), rel=0.02)
    hw = Hardware(gpu_bytes=(80 * GB,))
    job = Workload(batch_size=8, seq_len=64, micro_batch=8)
    eager = traffic_seconds(large, hw, job, range(large.n_blocks), False, 8)
    assert traffic_seconds(small, hw, job, range(small.n_blocks), False, 8) == pytest.approx(eager, rel=0.02)
    assert traffic_seconds(large, hw, replace(job, compile=True), range(large.n_blocks), False, 8) == pytest.approx(
        COMPILED * eager)
    slow = replace(hw, gpu_mem_gbps=hw.gpu_mem_gbps / 10)  # a memory ten times slower: the step slows with it
    fast_e = plan_for_config(small_llama(), hw, job, strategies=("zero2",)).candidates[0].estimate
    slow_e = plan_for_config(small_llama(), slow, job, strategies=("zero2",)).candidates[0].estimate
    # the trace's bytes, and the parameters' own: AdamW and clipping on the fp32 shard, FSDP2's copies
    moved = (traffic_seconds(large, hw, job, range(large.n_blocks), True, 8)
             + parameter_seconds(large, hw, job, 1, 1, gathers=1))
    assert slow_e.costs["compute"] - fast_e.costs["compute"] == pytest.approx(9 * moved, rel=0.02)
    n = large.trainable_params
    assert parameter_seconds(large, hw, job, 1, 1, gathers=1) * hw.gpu_mem_gbps * 1e9 * MEM_EFFICIENCY == pytest.approx(
        n * (ADAM + CLIP + GATHER + REDUCE))


def test_t5_self_attention_is_traced_on_the_math_path_cuda_takes_for_its_trained_bias():
    """CUDA's fused kernels do not differentiate a mask, so T5's self-attention (its relative position
    bias is a parameter's output) runs SDPA's math path in fp32 there, while its cross-attention and a
    Llama's attention run fused: the trace saves the fp32 probabilities and rates the fp32 matmuls."""
    from transformers import T5Config

    from bigfit.planning.devicecost import FP32_SHARE, MFU, traffic_seconds
    from bigfit.planning.profile import profile_model

    b, h, s, tt = 2, 4, 64, 16
    t5 = T5Config(d_model=64, d_ff=128, d_kv=16, num_heads=h, num_layers=2, num_decoder_layers=1, vocab_size=100,
                  dropout_rate=0.0, decoder_start_token_id=0)
    prof = profile_model(t5, b, s, tt, "bf16", autocast=True)
    assert min(prof.block_saved[:2]) >= 4 * b * h * s * s  # each encoder layer keeps its fp32 probabilities
    # forward FLOPs of the fp32 matmuls: scores and values, encoder (s x s) and decoder self-attention
    assert prof.block_fp32_flops == [2 * 2 * b * h * s * s * 16] * 2 + [2 * 2 * b * h * tt * tt * 16]
    llama = profile_model(small_llama(), b, s, 0, "bf16", autocast=True)
    assert not any(llama.block_fp32_flops)
    hw = Hardware(gpu_bytes=(80 * GB,))
    job = Workload(batch_size=b, seq_len=s, target_len=tt, micro_batch=b)
    bare = replace(prof, block_fp32_flops=[])
    extra = traffic_seconds(prof, hw, job, range(3), False, b) - traffic_seconds(bare, hw, job, range(3), False, b)
    assert extra == pytest.approx(3 * sum(prof.block_fp32_flops) * (1 / FP32_SHARE - 1) / (hw.gpu_tflops * 1e12 * MFU))


def test_an_fp32_job_on_a_gpu_rates_its_matmuls_off_the_tensor_cores():
    """torch leaves TF32 off: an fp32 job's matmuls run at FP32_SHARE of the bf16 peak on a GPU (single
    fp32 on the H200 took 3.25 s a step where bf16 took 0.87), while a CPU machine's rates are fp32's."""
    from bigfit.planning.devicecost import FP32_SHARE, MFU, matmul_flops_per_s
    from bigfit.planning.estimate import step_time
    from bigfit.planning.profile import profile_model

    hw = Hardware(gpu_bytes=(80 * GB,))
    assert matmul_flops_per_s(hw, "bf16") == hw.gpu_tflops * 1e12 * MFU
    assert matmul_flops_per_s(hw, "fp32") == pytest.approx(FP32_SHARE * matmul_flops_per_s(hw, "bf16"))
    assert matmul_flops_per_s(replace(hw, device="cpu"), "fp32") == matmul_flops_per_s(hw, "bf16")
    prof = profile_model(small_llama(), 8, 64, 0, "fp32")
    compute = {p: step_time("single", prof, hw, 0, False, 8 * 64, 1, precision=p)["compute"] for p in ("bf16", "fp32")}
    assert compute["fp32"] == pytest.approx(compute["bf16"] / FP32_SHARE)

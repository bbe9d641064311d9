"""The GPU's memory-bound time in the planner's step times (planning/devicecost.py): the bytes the
trace's non-matmul operators read and write (profile.py's `block_traffic`), counted exactly on a
known operator, growing with the batch, lowered by compiling, and added to the FLOPs' time."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bigfit.hardware import Hardware
from bigfit.planning.job import Job

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
    from bigfit.planning.devicecost import COMPILED, traffic_seconds
    from bigfit.planning.profile import profile_model
    from bigfit.planning.search import plan_for_config

    small = profile_model(small_llama(), 2, 64, 0, "bf16")
    large = profile_model(small_llama(), 8, 64, 0, "bf16")
    assert all(t > 0 for t in small.block_traffic) and small.other_traffic > 0
    assert sum(large.block_traffic) == pytest.approx(4 * sum(small.block_traffic), rel=0.02)
    hw = Hardware(gpu_bytes=(80 * GB,))
    job = Job(batch_size=8, seq_len=64, micro_batch=8)
    eager = traffic_seconds(large, hw, job, range(large.n_blocks), False, 8)
    assert traffic_seconds(small, hw, job, range(small.n_blocks), False, 8) == pytest.approx(eager, rel=0.02)
    assert traffic_seconds(large, hw, replace(job, compile=True), range(large.n_blocks), False, 8) == pytest.approx(
        COMPILED * eager)
    slow = replace(hw, gpu_mem_gbps=hw.gpu_mem_gbps / 10)  # a memory ten times slower: the step slows with it
    fast_e = plan_for_config(small_llama(), hw, job, strategies=("zero2",)).candidates[0].estimate
    slow_e = plan_for_config(small_llama(), slow, job, strategies=("zero2",)).candidates[0].estimate
    assert slow_e.costs["compute"] - fast_e.costs["compute"] == pytest.approx(
        9 * traffic_seconds(large, hw, job, range(large.n_blocks), True, 8), rel=0.02)

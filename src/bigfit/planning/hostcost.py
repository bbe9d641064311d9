"""The host's cost of issuing a step's kernels. In eager mode every operator a block's forward
dispatches costs the host its Python, dispatcher and launch time, and its backward the autograd
engine's, whatever the micro-batch's size: a T5-large micro-batch costs the H200 machine's host about
0.3 s to issue at batch 32 and at 64 alike (benchmarks/RESULTS.md, device maps). So a GPU's work on a
micro-batch or a pipeline chunk takes at least its issue time, and small chunks of a big model can be
bound by the host, not the GPU. Pure arithmetic on the trace's operator counts (profile.py) and the
machine's measured cost per operator (hardware.Hardware.host_op_us, `bigfit plan --calibrate`)."""
from __future__ import annotations

from collections.abc import Iterable

# The recompute of activation checkpointing issues each block's forward again: a third more, as its FLOPs.
RECOMPUTE = 4 / 3
# What a compiled block (torch.compile, inductor, dynamic shapes as engine/compiling.py compiles it)
# keeps of eager's issue cost: its kernels are fewer, but each call still runs the compiled code's
# guards and shape arithmetic and autograd's wrapper. Measured on the H200 machine on 2026-12-04
# (benchmarks/host_issue.py --compile 0,1, one short sample): a 1.2B Llama 0.54, T5-large 0.67 (it was
# assumed 0.1 before, which read compiled T5-large maps 24-44% fast).
COMPILED = 0.6


def pass_seconds(prof, hw, job, blocks: Iterable[int], outside: bool = True) -> float:
    """Host seconds to issue one forward and backward of `blocks` (indices into the profile's blocks)
    for one micro-batch or chunk, and of the parts outside the blocks (embeddings, head, loss) when
    `outside`. A profile without operator counts (built by hand) issues in no time."""
    counts, blocks = prof.block_ops or [0] * prof.n_blocks, list(blocks)
    again = job.checkpointed(prof.stacks, prof.n_blocks)  # the checkpointed blocks' forward runs twice
    ops = sum(counts[g] for g in blocks) * (COMPILED if job.compile else 1.0)
    if all(again[g] for g in blocks):
        ops *= RECOMPUTE if job.checkpointing else 1.0
    else:
        ops += sum(counts[g] for g in blocks if again[g]) * (COMPILED if job.compile else 1.0) * (RECOMPUTE - 1)
    return (ops + (prof.other_ops if outside else 0)) * hw.host_op_us * 1e-6


# FSDP2's own host work per unit and micro-batch: its pre- and post-forward and backward hooks, the
# all-gathers' copy-in and copy-out, the reduce-scatter's: zero2 and zero3 took 8-14 ms a step more
# than single on a 16-block 1.2B Llama at 4 x 1024 on the H200 machine, host-bound rows
# (tests/data/h200_measured.json ss1, ss3), about 0.8 ms for each of its 17 units.
FSDP_UNIT_S = 0.8e-3


# The forward's share of a step's issue cost, the rest its backward's (benchmarks/host_issue.py, the H200
# machine, two calls on 2026-12-04, one short sample: T5-large 0.45 and 0.37, a 1.2B Llama 0.31 and
# 0.34, the calibration's small Llama 0.50).
FORWARD_SHARE = 0.4


# torch.distributed.pipelining's host work per stage action (one chunk's forward or backward through a
# stage: the schedule's Python, the stage's input and output handling, its sends and receives). On 2
# GPUs (3.6B Llama, 4 and 8 chunks, 2026-11-29) the interleaved schedule, with twice 1F1B's actions,
# took 0.389 and 0.744 s against 1F1B's 0.382 and 0.694 although its bubble is half as long.
PIPELINE_ACTION_S = 3e-3


# The device map's hooks per block and pass (moving inputs to the block's device, casts): a 1.2B Llama
# mapped whole onto one GPU took 9 ms a step more than single at 4 x 1024, 16 blocks (ss1 in
# tests/data/h200_measured.json).
HOOK_S = 0.5e-3


def step_seconds(prof, hw, job, passes: int, fsdp: bool = False) -> float:
    """Host seconds to issue a whole step of the whole model: `passes` micro-batches (or chunks), with
    FSDP2's hooks per unit (its blocks and the root) where it shards."""
    units = (prof.n_blocks + 1) * FSDP_UNIT_S if fsdp else 0.0
    return passes * (pass_seconds(prof, hw, job, range(prof.n_blocks)) + units)

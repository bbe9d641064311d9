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
# What a compiled block (torch.compile, inductor) keeps of eager's issue cost: its forward and backward
# become a few fused graphs. Assumed, not measured (compiling costs 40-60 s a model, kept out of
# calibration); inductor fuses a T5 or Llama block's ~200 operators into a few dozen kernels.
COMPILED = 0.1


def pass_seconds(prof, hw, job, blocks: Iterable[int], outside: bool = True) -> float:
    """Host seconds to issue one forward and backward of `blocks` (indices into the profile's blocks)
    for one micro-batch or chunk, and of the parts outside the blocks (embeddings, head, loss) when
    `outside`. A profile without operator counts (built by hand) issues in no time."""
    counts = prof.block_ops or [0] * prof.n_blocks
    ops = sum(counts[g] for g in blocks) * (COMPILED if job.compile else 1.0)
    ops *= RECOMPUTE if job.checkpointing else 1.0
    return (ops + (prof.other_ops if outside else 0)) * hw.host_op_us * 1e-6


# FSDP2's own host work per unit and micro-batch: its pre- and post-forward and backward hooks, the
# all-gathers' copy-in and copy-out, the reduce-scatter's: zero2 and zero3 took 8-14 ms a step more
# than single on a 16-block 1.2B Llama at 4 x 1024 on the H200 machine, host-bound rows
# (tests/data/h200_measured.json ss1, ss3), about 0.8 ms for each of its 17 units.
FSDP_UNIT_S = 0.8e-3


# The device map's hooks per block and pass (moving inputs to the block's device, casts): a 1.2B Llama
# mapped whole onto one GPU took 9 ms a step more than single at 4 x 1024, 16 blocks (ss1 in
# tests/data/h200_measured.json).
HOOK_S = 0.5e-3


def step_seconds(prof, hw, job, passes: int, fsdp: bool = False) -> float:
    """Host seconds to issue a whole step of the whole model: `passes` micro-batches (or chunks), with
    FSDP2's hooks per unit (its blocks and the root) where it shards."""
    units = (prof.n_blocks + 1) * FSDP_UNIT_S if fsdp else 0.0
    return passes * (pass_seconds(prof, hw, job, range(prof.n_blocks)) + units)

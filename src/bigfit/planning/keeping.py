"""How a job keeps what backward needs, as the planner rates it: the chunked LM head and loss
(`chunk_loss`), one context-parallel rank's share of the activations (`context_share`, with the keys
and values it gathers and their traffic, `context_seconds`), and `--activations auto`'s choice per row
(`choose_keeping`): keep, checkpoint the fewest blocks that fits, checkpoint all, or offload the checkpointed
blocks' inputs to host RAM. Pure, on a ModelProfile (profile.py) and the Workload; the engines that
run these are engine/'s (docs/planning.md, "Long sequences")."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..layout.activations import loss_chunk_tokens
from .workload import Workload


def chunk_loss(prof, job: Workload, out_tokens: float):
    """`prof` with the LM head and loss computed in chunks (--loss-chunk, layout/activations.py's rule
    for the `out_tokens` output tokens of one micro-batch on one rank): one chunk's logits, their fp32
    copies and gradients exist at a time (logits_bytes, logits_numel, the loss's saved log-softmax), and
    the head's matmul runs again in backward for each chunk (2 x its weight FLOPs an output token, on
    top of the model's: flops_per_token for the data-parallel rows, head_flops_again for the per-device
    ones). Unchanged where the whole logits are computed at once."""
    k = loss_chunk_tokens(job.loss_chunk, int(out_tokens), prof.vocab) if prof.vocab and out_tokens >= 1 else 0
    if not k:
        return prof
    f = k / out_tokens
    again = 2 * prof.head_params
    return replace(prof, other_saved=prof.other_saved - prof.loss_saved * (1 - f), loss_saved=prof.loss_saved * f,
                   logits_bytes=prof.logits_bytes * f, logits_numel=prof.logits_numel * f,
                   flops_per_token=prof.flops_per_token + again * out_tokens / max(1, prof.tokens),
                   head_flops_again=prof.head_flops_again + again)


def gathered_kv(prof, tp: int, cp: int, c: int) -> float:
    """Bytes of the keys and values one block's attention gathers from the other context-parallel ranks
    for its micro-batch (the whole sequence's, less this rank's own): 2 x tokens x key/value width
    (split by tp) in the compute dtype. `prof.tokens` is the micro-batch's whole sequences."""
    return 2 * prof.tokens * prof.kv_width / tp * c * (cp - 1) / cp


def context_share(prof, tp: int, cp: int, c: int):
    """One context-parallel rank's part of a (TP rank's) profile: seq/cp tokens of every sequence, so
    every saved tensor, block input, logit, byte of traffic and FLOP of its blocks divided by cp (the
    two slices a rank takes, one from either end, give each the same causal work); and each block's
    attention keeps the keys and values it gathered for backward (`gathered_kv`: with checkpointing they
    exist again during the block's recompute, its saved bytes then). FLOPs a token are unchanged: a
    rank computes 1/cp of the tokens."""
    if cp == 1:
        return prof
    kv = gathered_kv(prof, tp, cp, c)
    div = 1 / cp
    return replace(prof, block_saved=[b * div + kv for b in prof.block_saved],
                   block_inputs=[x * div for x in prof.block_inputs], other_saved=prof.other_saved * div,
                   loss_saved=prof.loss_saved * div, logits_bytes=prof.logits_bytes * div,
                   logits_numel=prof.logits_numel * div, tokens=prof.tokens * div,
                   block_traffic=[t * div for t in prof.block_traffic], other_traffic=prof.other_traffic * div,
                   block_fp32_flops=[f * div for f in prof.block_fp32_flops],
                   block_matmul_flops=[f * div for f in prof.block_matmul_flops],
                   block_attention_flops=[f * div for f in prof.block_attention_flops])


def context_seconds(whole, job: Workload, tp: int, cp: int, c: int, passes: int, link: float) -> float:
    """Seconds a step of context parallelism's own traffic: per block and micro-batch the keys and
    values all-gathered in forward, again in a checkpointed block's recompute, and their gradients
    reduce-scattered in backward, each moving `gathered_kv` bytes over the cp ranks' `link` (bytes/s).
    `whole`: the TP rank's profile before `context_share` (whole sequences); `passes`: micro-batches a step.
    Not overlapped: each gather feeds its own layer's attention, which waits for it (no prefetch across
    layers), and each gradient reduction its layer's key and value projections' backward; at long
    sequences it is small beside attention's work, which grows with the square of the length."""
    if cp == 1:
        return 0.0
    again = job.checkpointed(whole.stacks, whole.n_blocks)
    moves = sum(3 if on else 2 for on in again)
    return moves * gathered_kv(whole, tp, cp, c) * passes / link


def recompute_share(prof, job: Workload) -> float:
    """The share of the blocks' FLOPs that checkpointing runs again (1 where every block is: the 4/3
    of estimate.step_time), weighted by each block's FLOPs (its parameters where not traced)."""
    again = job.checkpointed(prof.stacks, prof.n_blocks)
    if all(again):
        return 1.0 if job.checkpointing else 0.0
    weight = ([m + a for m, a in zip(prof.block_matmul_flops, prof.block_attention_flops)]
              if prof.block_matmul_flops else prof.block_params)
    whole = sum(weight)
    return sum(w for w, on in zip(weight, again) if on) / whole if whole else 0.0


# --activations offload's times rest on copies overlapping compute that no GPU run has measured yet: on a
# near tie (micro-batch auto's rows at their own sizes), the checkpointed row is taken (as search.SPLIT_MARGIN)
OFFLOAD_MARGIN = 1.10


def fixed(job: Workload, how: str, blocks: int | None = None) -> Workload:
    """`job` with its activations kept as `how` (keep, checkpoint, offload) over `blocks` (None: all),
    nothing left to choose."""
    return replace(job, checkpointing=how != "keep", checkpoint_blocks=blocks if how != "keep" else None,
                   offload_activations=how == "offload", choose_activations=False)


def choose_keeping(rate: Callable[[Workload], object], fits: Callable[[object], bool], job: Workload, prof,
                   offload: bool = True, spills: bool = False):
    """The row (an Estimate, or a row holding one) `rate` gives for the way of keeping activations
    --activations auto takes for it: the fastest that fits. Rated alone where the job's way is fixed.
    Recomputing costs time and offload's copies run beside work they may not hide, so the fastest that
    fits is the first of: keep; checkpoint the fewest blocks of each stack that fits (every block at
    most; the memory falls as more blocks keep only their inputs, so a bisection finds it); offload the
    fewest blocks' inputs that fits (where `offload`: GPUs, whose host RAM is another memory; device maps
    and pipelines rate none). Where none fits, the most frugal's row, whose reason says how far over it
    is. The row carries its way (`Estimate.activations`, `checkpoint_blocks`). `fits`: the callers leave
    the allocator its share of each GPU (rows.roomy): the fewest blocks that barely fit would not run.
    `spills` (device maps): a row fits by moving blocks to the host, which computes them tens of times
    slower, so keep and checkpoint (every block) are both rated and the faster that fits taken."""
    if not job.choose_activations:
        return _marked(rate(job), job)
    keep = _marked(rate(fixed(job, "keep")), fixed(job, "keep"))
    if spills:
        every = _marked(rate(fixed(job, "checkpoint")), fixed(job, "checkpoint"))
        ok = [r for r in (keep, every) if fits(r)] or [every]
        return min(ok, key=lambda r: getattr(r, "estimate", r).step_time_s)  # a tie: keep, the first
    if fits(keep):
        return keep
    longest = max((n for _, n in prof.stacks), default=prof.n_blocks)
    frugal = keep
    for how in ("checkpoint", "offload") if offload else ("checkpoint",):
        found, frugal = _fewest(rate, fits, fixed(job, how), longest)
        if found is not None:
            return found
    return frugal


def _fewest(rate, fits, job: Workload, longest: int):
    """(the row of the fewest checkpointed blocks of each stack that fits, or None; the row of all)."""
    every = _marked(rate(job), job)
    if not fits(every):
        return None, every
    lo, hi, best = 1, longest - 1, every  # every block fits; find the fewest
    while lo <= hi:
        mid = (lo + hi) // 2
        e = _marked(rate(replace(job, checkpoint_blocks=mid)), replace(job, checkpoint_blocks=mid))
        if fits(e):
            best, hi = e, mid - 1
        else:
            lo = mid + 1
    return best, every


def _marked(row, job: Workload):
    """`row` (an Estimate, or a row holding one) with the way it was rated recorded on its Estimate
    (`activations`, `checkpoint_blocks`)."""
    e = getattr(row, "estimate", row)
    e.activations = "keep" if not job.checkpointing else "offload" if job.offload_activations else "checkpoint"
    e.checkpoint_blocks = job.checkpoint_blocks if job.checkpointing else None
    return row


def keeping_text(e) -> str:
    """How a row keeps its activations, as the table shows it: "", "checkpoint", "checkpoint 10 blocks",
    "offload" (keep says nothing)."""
    if e.activations == "keep":
        return ""
    return e.activations + (f" {e.checkpoint_blocks} blocks" if e.checkpoint_blocks is not None else "")


def settings_of(e) -> dict:
    """The TrainConfig settings that run a row's way of keeping activations (bigfit train's decision)."""
    return {"activations": e.activations, "checkpoint_blocks": e.checkpoint_blocks}

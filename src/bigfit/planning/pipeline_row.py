"""pipeline as a row of the plan: the model cut into stages by the pipeline's own cut (layout/cut.py:
contiguous runs of blocks balanced by parameters), one process per GPU of one node, every stage seeing
the whole batch (no data parallelism). Pure, from the ModelProfile traced at one process's whole
micro-batch (as for device_map), on the layout `--strategy pipeline` would resolve
(config.pipeline_defaults: schedule, stages per rank, chunks).

Memory per rank (docs/planning.md): its stages' blocks as the device-map balancer counts them (fp32
weights, gradients, AdamW moments, autocast's compute-dtype copy: planning/automap.py), the parameters
outside the blocks where the cut puts them (a copy on each rank that holds a tied one), the
activations of the chunks its schedule keeps in flight, the receive buffers torch allocates per
chunk, and on the last stage the loss's fp32 logits. Time: the slowest rank's compute stretched by
the bubble, plus its point-to-point receives, the tied gradients' all-reduce and the optimizer step
of the fullest rank. With LoRA frozen parameters have no gradient and no moments (adapters.py): no
optimizer step and no all-reduce of a frozen tied embedding; with a 4-bit base (QLoRA) each rank keeps
its stages' layers in NF4 and dequantizes one at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..common.precision import DTYPES
from ..errors import BigfitError
from ..layout.cut import PipelineLayout, balance, check_depth
from ..settings.config import pipeline_defaults
from .adapters import outside_frozen_share, without_frozen
from .automap import profile_costs, state_bytes
from .balance import size
from .estimate import KEYS, RESERVE, Estimate, _bytes
from .hostcost import PIPELINE_ACTION_S
from .quantized import transient
from .device_map_row import stage_seconds

NAME = "pipeline"
ADAM_BYTES = 28  # torch's AdamW per fp32 parameter: weight, gradient and two moments read; three written
HBM_BYTES_PER_S = 3e12  # GPU memory bandwidth an optimizer step reaches: assumed (2/3 of an H200's), not measured
ONE_STAGE = PipelineLayout(world=1, stages_per_rank=1, schedule="gpipe", chunks=1)  # what a refused layout shows


@dataclass
class PipelineRow:
    estimate: Estimate
    section: dict  # the layout, the cut and each rank's bytes against its GPU: the plan's `pipeline`
    no_fit: str | None  # a rank over its GPU
    not_candidate: str | None  # why it cannot be recommended although it may fit


def pipeline_row(prof, hw, job) -> PipelineRow:
    layout, why = _layout(prof, hw, job)
    runs = balance(prof.block_params, layout.stages)  # the cut training makes (layout/split.py plan_split)
    ranks = rank_bytes(prof, job, layout, runs)
    budgets = [hw.gpu_bytes[r % hw.gpus_per_node] - RESERVE for r in range(layout.world)]
    shown = max(range(layout.world), key=lambda r: ranks[r]["total"])
    costs, bubble = _costs(prof, hw, job, layout, runs, ranks)
    label = f"compute (pipeline bubble {bubble:.0%})" if layout.world > 1 else "compute (one stage: the whole job)"
    built = _bytes(buffers=0 if job.load_in_4bit else 4 * prof.params)  # a 4-bit base is made on the GPUs
    e = Estimate(NAME, ranks[shown], built, sum(costs.values()), costs, labels={"compute": label})
    return PipelineRow(e, _section(prof, layout, runs, ranks, budgets, shown), _no_fit(ranks, budgets), why)


def _layout(prof, hw, job) -> tuple[PipelineLayout, str | None]:
    """The layout training would resolve with one process per GPU, and why the row is not a candidate.
    A layout training would refuse is shown as one stage (the whole job on one GPU), with its reason."""
    micro = job.micro(1)  # every stage reads the whole batch
    schedule, per, chunks = pipeline_defaults(job.pipeline_schedule, job.stages_per_rank, job.chunks, hw.world_size,
                                              micro)
    why = _not_candidate(hw)
    try:
        if prof.pipeline_error:
            raise BigfitError(prof.pipeline_error)
        layout = PipelineLayout(world=hw.world_size, stages_per_rank=per, schedule=schedule, chunks=chunks)
        check_depth(prof.n_blocks, layout, " + ".join(f"{n} in {path}" for path, n in prof.stacks))
        if micro % chunks:
            raise BigfitError(f"--chunks {chunks} must divide the micro-batch of {micro} samples")
    except BigfitError as e:
        return ONE_STAGE, why or str(e)
    return layout, why


def _not_candidate(hw) -> str | None:
    if hw.device == "cpu":
        return "a CPU-only machine: pipeline stages are processes on GPUs (on the CPU they would share its cores)"
    if hw.world_size == 1:
        return "one GPU: a pipeline needs 2 or more, one stage (process) on each"
    if hw.nodes > 1:
        return (f"stages over {hw.nodes} nodes are not rated (and pipeline x data parallel is not supported yet); "
                "zero3 spans nodes")
    return None


def in_flight(layout: PipelineLayout, rank: int) -> list[int]:
    """Chunks whose activations `rank` holds at once, for each of its stages (stages_of order). GPipe:
    all of them. 1F1B: stage s runs stages - s forwards before its first backward (torch's Schedule1F1B).
    Interleaved: torch's warmup forwards (_get_warmup_ops) and the first of the steady phase, forward i
    running the rank's stage (i // chunks per round) % stages per rank."""
    m, w, v = layout.chunks, layout.world, layout.stages_per_rank
    if layout.schedule == "gpipe":
        return [m] * v
    if layout.schedule == "1f1b":
        return [min(m, layout.stages - rank)]
    per_round = m // max(1, m // w)
    counts = [0] * v
    for i in range(min((v - 1) * per_round + 2 * (w - 1 - rank) + 1, m * v)):
        counts[(i // per_round) % v] += 1
    return counts


def rank_bytes(prof, job, layout, runs) -> list[dict[str, int]]:
    """Each rank's bytes by kind (estimate.KEYS) when its schedule holds the most chunks: a sum of
    everything it holds then, gradients included (they exist from the first backward on)."""
    cost = profile_costs(prof, job)  # a frozen parameter: no gradient, no moments (adapters.frozen_costs)
    c, m, last = DTYPES[job.precision].itemsize, layout.chunks, layout.stages - 1
    ranks = [dict.fromkeys(KEYS, 0.0) for _ in range(layout.world)]
    per_chunk = []  # each stage's activations of one chunk; the last stage's head and loss too
    for s, (a, b) in enumerate(runs):
        for part in cost.parts[a:b]:
            _add(ranks[layout.rank_of(s)], {k: v for k, v in part.items() if k != "activations"})
        per_chunk.append((sum(p["activations"] for p in cost.parts[a:b]) + (prof.other_saved if s == last else 0)) / m)
    for r, nbytes in enumerate(received(prof, layout, runs)):  # one buffer per chunk: the whole micro-batch
        ranks[r]["buffers"] += nbytes
    frozen = outside_frozen_share(prof)
    for n, held in holders(prof, layout, runs):
        for r in held:
            _add(ranks[r], without_frozen(state_bytes(n, c), n * frozen, c))
    for r, held in enumerate(ranks):
        stages = layout.stages_of(r)
        held["activations"] = sum(k * per_chunk[s] for k, s in zip(in_flight(layout, r), stages))
        again = job.checkpointed(prof.stacks, prof.n_blocks)
        if job.checkpointing:  # one checkpointed block's activations again while it is recomputed, for one chunk
            held["activations"] += max((prof.block_saved[g] for s in stages for g in range(*runs[s]) if again[g]),
                                       default=0) / m
        if job.load_in_4bit:  # one layer dequantized at a time (bitsandbytes: a rank holds whole layers)
            held["buffers"] += transient(prof)
    logits32 = 4 * (prof.logits_numel or prof.logits_bytes // c)
    ranks[layout.rank_of(last)]["buffers"] += 2 * logits32 / m  # the loss of one chunk (estimate.memory's loss moment)
    return [_bytes(**r) for r in ranks]


def _add(into: dict, parts: dict) -> None:
    for k, v in parts.items():
        into[k] += v


def received(prof, layout, runs) -> list[int]:
    """Bytes each rank receives per micro-batch: every stage but the first its input, every stage but
    the last its output's gradient (as large as the next stage's input). A block's traced inputs are
    the hidden state with whatever goes with it (masks, position bias, encoder output): an upper bound
    on what the pipeline sends, whose stages recompute their masks."""
    out = [0] * layout.world
    for s, (a, b) in enumerate(runs):
        last = s == layout.stages - 1
        out[layout.rank_of(s)] += (prof.block_inputs[a] if s else 0) + (0 if last else prof.block_inputs[b])
    return out


def holders(prof, layout, runs) -> list[tuple[int, set[int]]]:
    """(elements, the ranks holding it) of each parameter outside the blocks, where the cut puts it
    (profile.outside, from layout.split.anchors). No placement (a model the pipeline cannot cut,
    shown as one stage): the one stage holds them."""
    where = prof.outside or [(prof.root_params, (0,), 0)]
    stage_of = {g: s for s, (a, b) in enumerate(runs) for g in range(a, b)}
    return [(n, {layout.rank_of(stage_of[g]) for g in blocks}) for n, blocks, _ in where]


def _costs(prof, hw, job, layout, runs, ranks) -> tuple[dict[str, float], float]:
    """Seconds per step of each cost, and the bubble's share of the compute. The slowest rank's compute
    (device_map's per-device FLOPs) over m chunks takes m + (p - 1) / v chunk-times: the fill and drain
    of p ranks, shortened v times by v stages per rank (interleaved). Receives wait for the sender, so
    they add; the tied gradients are all-reduced and the optimizer steps after the schedule."""
    devices = [f"cuda:{layout.rank_of(s)}" for s, (a, b) in enumerate(runs) for _ in range(a, b)]
    m, idle = layout.chunks, (layout.world - 1) / layout.stages_per_rank
    link, accum = hw.intra_gbps * 1e9, max(1, job.batch_size // job.micro(1))
    busy = stage_seconds(prof, hw, job, devices, f"cuda:{layout.rank_of(layout.stages - 1)}", accum * m,
                         2 * layout.stages_per_rank * PIPELINE_ACTION_S)
    tied = [(n, len(held)) for n, held in holders(prof, layout, runs) if len(held) > 1]
    trains = 1 - outside_frozen_share(prof)  # a frozen tied parameter has no gradient to sum
    costs = {"compute": max(busy.values()) * (m + idle) / m,
             "point-to-point": max(received(prof, layout, runs)) * accum / link,
             "tied all-reduce": sum(2 * 4 * n * trains * (k - 1) / k for n, k in tied) / link,  # fp32 gradients, a ring
             # AdamW over the trainable parameters: 8 bytes of moments each
             "optimizer": max(r["optimizer"] for r in ranks) / 8 * ADAM_BYTES / HBM_BYTES_PER_S}
    return costs, idle / (m + idle)


def _no_fit(ranks: list[dict], budgets: list[int]) -> str | None:
    over = [(t["total"] - cap, r) for r, (t, cap) in enumerate(zip(ranks, budgets)) if t["total"] > cap]
    if not over:
        return None
    excess, r = max(over)
    worst = max(KEYS, key=ranks[r].get)
    return (f"rank {r} needs {ranks[r]['total'] / 1e9:.1f} GB, {excess / 1e9:.1f} GB more than its GPU offers "
            f"(largest part: {worst} {ranks[r][worst] / 1e9:.1f} GB)")


def _section(prof, layout, runs, ranks, budgets, shown) -> dict:
    names = [f"{path}.{i}" for path, n in prof.stacks for i in range(n)]
    cut = "; ".join(f"stage {s} (rank {layout.rank_of(s)}): {names[a]}" + (f"..{names[b - 1]}" if b - a > 1 else "")
                    for s, (a, b) in enumerate(runs))
    devices = {f"rank {r}": {"predicted_bytes": t["total"], "budget_bytes": budgets[r], "parts": {k: t[k] for k in KEYS}}
               for r, t in enumerate(ranks)}
    return {"schedule": layout.schedule, "stages": layout.stages, "stages_per_rank": layout.stages_per_rank,
            "chunks": layout.chunks, "runs": runs, "describe": cut, "devices": devices, "shown": f"rank {shown}",
            "text": ", ".join(f"{d} {size(v['predicted_bytes'])} of {size(v['budget_bytes'])}"
                              for d, v in devices.items())}

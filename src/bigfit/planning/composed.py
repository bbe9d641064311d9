"""Memory and step time of a composed layout: a ParallelPlan whose pipeline (pp), data-parallel
(dp_replicate x dp_shard), context-parallel (cp) and tensor-parallel (tp) degrees are not those of one
named strategy. Pure, from the data-parallel ModelProfile (traced at job.micro(world)), scaled to one
rank's part (a context-parallel rank: 1/cp of every sequence and the keys and values it gathers,
keeping.context_share), its activations kept as the job says (keeping.py).

- `share`: one TP rank's view of the model: the blocks' split parameters and divided activations
  over tp (tp_trace.py), embeddings, head, logits and loss over tp where the vocabulary splits,
  the replicated parts (norms, the residual stream; embeddings and head where it does not) whole,
  activations scaled to the layout's micro-batch (saved tensors grow with its samples).
- Without a pipeline a rank is a data-parallel rank of that smaller model: estimate.memory of the
  engine that runs it over dp_shard (HSDP's replicas each hold what dp_shard alone holds), so a
  composed row with tp 1 counts exactly as the named rows do.
- With a pipeline each position holds what pipeline_row.py counts for its stages (the same cut, the
  chunks its schedule keeps in flight), of that smaller model, divided over dp_shard by ZeRO stage;
  under the offload engine only compute-dtype parameters and fp32 gradient accumulators stay on the
  GPU, the rest is host RAM.
Times: compute per rank (its tokens, its share of the FLOPs) stretched by the bubble, TP's
all-reduces (blocking, on the node's link), the data-parallel traffic (overlapped with compute),
the pipeline's sends and the host steps of zero3-offload and of the offload engine over pipeline
stages (docs/planning.md, "Composed plans"). With LoRA, gradients, optimizer states and their
traffic count the trainable parameters alone (adapters.py); gathers and parameters every one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..common.precision import DTYPES
from ..layout.cut import PipelineLayout
from .adapters import outside_frozen_share, scaled_frozen
from .estimate import FSDP_HOST_ADAM, KEYS, Estimate, _bytes, activation_copies, grad_bytes, host_adam_rate, memory
from .keeping import chunk_loss, context_seconds, context_share
from .hostcost import PIPELINE_ACTION_S
from .device_map_row import stage_seconds
from .pipeline_row import holders, rank_bytes, received

# The fraction of a block's compute speed kept per doubling of tp, its matmuls 1/tp as wide: an
# assumption awaiting a multi-GPU measurement (none was available); Megatron-LM's published
# intra-node scaling loses a few percent per doubling.
TP_EFFICIENCY = 0.95


@dataclass(frozen=True)
class Pipe:
    layout: PipelineLayout  # one pipeline position per rank of a data-parallel x tensor-parallel group
    runs: list[tuple[int, int]]  # each stage's blocks [start, stop): layout/cut.py's balance


def share(prof, tp: int, scale: float, sequence: bool = False):
    """One TP rank's part of the model, at `scale` times the traced micro-batch: the blocks' split
    parameters and saved tensors over tp, and where the degree divides the vocabulary (as
    tensor.plans.splits_vocab) the embeddings, head, logits and loss too, with the embedding's
    forward all-reduce and the head's input-gradient all-reduce added to the first and last blocks'.
    `sequence`: sequence parallelism divides the blocks' norms' and residual stream's tensors too."""
    cut = 1 - 1 / tp
    vcut = cut if prof.vocab_rows and prof.vocab_rows % tp == 0 else 0.0
    split = prof.block_tp_params or [0] * prof.n_blocks
    divided = prof.block_tp_saved or [0] * prof.n_blocks
    if sequence:
        divided = [d + s for d, s in zip(divided, prof.block_sp_saved or [0] * prof.n_blocks)]
    blocks = [n - s * cut for n, s in zip(prof.block_params, split)]
    params = prof.params - sum(split) * cut - prof.vocab_params * vcut
    embedding = prof.embedding_params * (1 - vcut)
    attention = prof.attention_per_token  # split by heads too
    ratio = (params - embedding) / max(1, prof.params - prof.embedding_params)  # the matmuls' share this rank keeps
    kept = [b / max(1, n) for b, n in zip(blocks, prof.block_params)]
    reduce = [list(r) for r in prof.tp_reduce]
    if vcut and reduce:
        reduce[0][0] += prof.hidden
        reduce[-1][1] += prof.hidden
    logits = (1 - vcut) * scale
    return replace(prof, params=params, embedding_params=embedding, largest_unit_params=max(blocks, default=0),
                   root_params=prof.root_params - prof.vocab_params * vcut, block_params=blocks,
                   head_params=prof.head_params * (1 - vcut),
                   matmul_params=max(0, prof.matmul_params - sum(split) * cut - prof.head_params * vcut),
                   flops_per_token=(prof.flops_per_token - attention) * ratio + attention / tp,
                   block_matmul_flops=[f * k for f, k in zip(prof.block_matmul_flops, kept)],
                   block_attention_flops=[f / tp for f in prof.block_attention_flops],
                   block_fp32_flops=[f * scale / tp for f in prof.block_fp32_flops],  # attention's, by heads
                   block_saved=[(a - d * cut) * scale for a, d in zip(prof.block_saved, divided)],
                   # the operators' bytes as the saved ones: TP divides the same tensors
                   block_traffic=[t * (a - d * cut) * scale / max(1, a)
                                  for t, a, d in zip(prof.block_traffic, prof.block_saved, divided)],
                   other_traffic=prof.other_traffic * scale,
                   block_inputs=[x * scale for x in prof.block_inputs],
                   other_saved=(prof.other_saved - prof.loss_saved * vcut) * scale, loss_saved=prof.loss_saved * logits,
                   logits_bytes=prof.logits_bytes * logits, logits_numel=prof.logits_numel * logits,
                   tokens=prof.tokens * scale, tp_reduce=[tuple(r) for r in reduce],
                   outside=[(n * (1 - vcut) if rows == prof.vocab_rows else n, at, rows)
                            for n, at, rows in prof.outside], **scaled_frozen(prof, blocks, params))


def estimate(name: str, plan, prof, hw, job, micro: int, pipe: Pipe | None = None) -> Estimate:
    """The row of `plan`: `micro` samples per micro-batch on each data-parallel rank, the activations
    kept as `job` says (keeping.py: checkpointed blocks, their inputs offloaded, the loss in chunks), a
    context-parallel rank holding 1/cp of every sequence (keeping.context_share)."""
    c = DTYPES[job.precision].itemsize
    accum = job.batch_size // (micro * plan.dp)
    whole = share(prof, plan.tp, micro / job.micro(hw.world_size), plan.sequence_parallel)
    rank = context_share(whole, plan.tp, plan.cp, c)
    rank = chunk_loss(rank, job, micro * (job.target_len or job.seq_len) / plan.cp)
    flags = job.checkpointed(rank.stacks, rank.n_blocks)
    if pipe is None:  # FSDP2 shards over dp_shard x cp, and DDP reduces over dp x cp (layout/mesh.py)
        gpu, host = memory(_row_of(plan), rank, hw, c, job.checkpointing, accum,
                           shards=plan.dp_shard * plan.cp if plan.engine == "fsdp" else plan.grad_ranks,
                           blocks=flags, offload=job.offload_activations)
    else:
        gpu, host = _positions(plan, rank, job, c, pipe), _offloaded_host(plan, rank, hw, job, pipe)
    # the host holds rank 0's whole fp32 model while it is spread, as in every multi-process row
    host = _bytes(**{**{k: host[k] for k in KEYS}, "buffers": 4 * prof.params})
    costs, label = _costs(plan, rank, hw, job, c, micro, accum, pipe)
    if plan.cp > 1:
        costs["context parallel"] = context_seconds(whole, job, plan.tp, plan.cp, c, accum,
                                                    link(hw, plan.tp * plan.cp))
    if job.checkpointing and job.offload_activations:
        costs["activation offload"] = activation_copies(rank.offloaded(flags) * accum, hw)
    # communication and offloaded activations' copies overlap compute; the rest waits or follows
    beside = ("compute", "communication", "activation offload")
    step = max(costs.get(k, 0.0) for k in beside) + sum(v for k, v in costs.items() if k not in beside)
    return Estimate(name, gpu, host, step, costs, labels={"compute": label})


def _row_of(plan) -> str:
    """The named row whose arithmetic one rank follows: its engine, on a model of the rank's part."""
    if plan.offload_params:
        return "zero3-offload"
    return {"fsdp": f"zero{plan.zero}", "ddp": "zero1" if plan.zero == 1 else "ddp", "local": "single"}[plan.engine]


def _positions(plan, rank, job, c: int, pipe: Pipe) -> dict[str, int]:
    """The fullest position: pipeline_row.py's bytes (fp32 states, autocast's compute-dtype copy, chunks in
    flight, receive buffers, the loss), the states divided over dp_shard by the ZeRO stage. FSDP2's
    units are the blocks (pipeline/runner.py shard_stages) and torch's stage does not wrap them, so
    they reshard after each chunk as outside a pipeline: zero2 keeps the position's parameters
    gathered in the compute dtype (in place of autocast's copy), zero3 two units and one unit's
    unsharded gradients."""
    out = []
    for r, held in enumerate(rank_bytes(rank, job, pipe.layout, pipe.runs)):
        parts = {k: held[k] for k in KEYS}
        n, dps = parts["params"] / 4, plan.dp_shard
        if plan.engine == "offload":  # compute-dtype parameters, fp32 accumulators; the states on the host
            parts.update(params=c * n, optimizer=0, buffers=parts["buffers"] - (c * n if c < 4 else 0))
        elif plan.offload_params:  # zero3-offload: shards, gradients and states on the host
            parts.update(params=0, grads=0, optimizer=0)
        elif plan.zero >= 1:
            parts["optimizer"] /= dps
        if plan.zero >= 2:
            mine = [g for s in pipe.layout.stages_of(r) for g in range(*pipe.runs[s])]
            unit = max(rank.block_params[g] for g in mine)
            grads = max(rank.block_params[g] - rank.blocks_frozen()[g] for g in mine)  # its trainable ones
            parts["params"], parts["grads"] = parts["params"] / dps, parts["grads"] / dps
            gathered = c * n if plan.zero == 2 else 2 * c * unit + 4 * grads
            parts["buffers"] += gathered - (c * n if c < 4 else 0)
        out.append(_bytes(**parts))
    return max(out, key=lambda b: b["total"])


def _offloaded_host(plan, rank, hw, job, pipe: Pipe) -> dict[str, int]:
    """The node's host bytes over pipeline stages, for each of its ranks' share of the fullest position
    over dp_shard: the offload engine's fp32 master rows and moments (12 bytes a parameter) and
    gradient rows; zero3-offload's fp32 shards, gradients and moments (16 bytes a parameter)."""
    rows = _offloaded_rows(plan, rank, pipe) * hw.gpus_per_node
    trained = _offloaded_rows(plan, rank, pipe, trainable=True) * hw.gpus_per_node
    if plan.offload_params:
        return _bytes(params=4 * rows, grads=4 * trained, optimizer=8 * trained)
    if plan.engine != "offload":
        return _bytes()
    return _bytes(optimizer=12 * trained, grads=grad_bytes(job.precision, hw.cpu_adam_kernel) * trained)


def _offloaded_rows(plan, rank, pipe: Pipe, trainable: bool = False) -> float:
    """The parameters whose states one rank keeps on the host: the fullest position's over dp_shard
    (`trainable`: of those, the ones with gradients and optimizer states)."""
    return max(_position_params(rank, pipe, trainable)) / plan.dp_shard


def link(hw, inner: int) -> float:
    """Bytes/s of a group whose ranks lie within `inner` consecutive ranks (the mesh's inner degrees
    times its own): the node's link when that span divides a node, else its share of the node's."""
    if hw.nodes > 1 and hw.gpus_per_node % inner:
        return hw.inter_gbps / hw.gpus_per_node * 1e9
    return hw.intra_gbps * 1e9


def _costs(plan, rank, hw, job, c: int, micro: int, accum: int, pipe: Pipe | None) -> tuple[dict, str]:
    # one rank's samples, and with context parallelism its 1/cp of each sequence (decoder-only)
    per_rank = replace(job, batch_size=job.batch_size // plan.dp, micro_batch=micro, seq_len=job.seq_len // plan.cp)
    if pipe:
        layout, runs = pipe.layout, pipe.runs
        where = [layout.rank_of(s) for s, (a, b) in enumerate(runs) for _ in range(a, b)]
        last, m, idle = layout.rank_of(layout.stages - 1), layout.chunks, (layout.world - 1) / layout.stages_per_rank
    else:
        where, last, m, idle = [0] * rank.n_blocks, 0, 1, 0.0
    actions = 2 * pipe.layout.stages_per_rank * PIPELINE_ACTION_S if pipe else 0.0
    busy = stage_seconds(rank, hw, per_rank, [f"cuda:{r}" for r in where], f"cuda:{last}", accum * m, actions)
    stretch = (m + idle) / m  # the fill and drain of the pipeline: its bubble
    tokens = per_rank.batch_size * (per_rank.seq_len + job.target_len)
    costs = {"compute": max(busy.values()) / TP_EFFICIENCY ** math.log2(plan.tp) * stretch,
             "tensor parallel": _tp_seconds(rank, hw, job, c, plan.tp, where, tokens) * stretch,
             **_dp_seconds(plan, rank, hw, c, accum, pipe)}
    if pipe:
        p2p = link(hw, plan.world)  # the stages are the mesh's outermost dimension: they span the job
        tied = [(n, len(ranks)) for n, ranks in holders(rank, layout, runs) if len(ranks) > 1]
        costs["point-to-point"] = max(received(rank, layout, runs)) * accum / p2p
        costs["tied all-reduce"] = sum(2 * 4 * n * (k - 1) / k for n, k in tied) / p2p  # fp32 gradients
    if plan.offload_params:  # zero3-offload: shards up for each chunk's forward and backward, gradients down, host step
        n = _offloaded_rows(plan, rank, pipe) if pipe else rank.params / plan.dp_shard
        t = _offloaded_rows(plan, rank, pipe, True) if pipe else rank.trainable_params / plan.dp_shard
        costs["pcie"] = (accum * m * 2 * 4 * n + 4 * t) / (hw.pcie_gbps * 1e9)
        costs["cpu_optimizer"] = t * hw.gpus_per_node / (hw.cpu_adam_params_per_s * FSDP_HOST_ADAM)
    if plan.engine == "offload" and pipe:  # after the schedule: gradient rows down, the host step, masters up
        n, g = _offloaded_rows(plan, rank, pipe, True), grad_bytes(job.precision, hw.cpu_adam_kernel)
        costs["pcie"] = (g + 4) * n / (hw.pcie_gbps * 1e9)
        costs["cpu_optimizer"] = n * hw.gpus_per_node / host_adam_rate(hw, g)
    label = f"compute (pipeline bubble {idle / (m + idle):.0%})" if pipe else "compute"
    return costs, label


def _tp_seconds(rank, hw, job, c: int, tp: int, where: list[int], tokens: float) -> float:
    """The busiest position's all-reduces of activations over its TP group, per step: each
    row-parallel output in forward (again in the recompute, with checkpointing), each column-parallel
    input's gradient in backward (tp_trace.py), as a ring on the node's link; they block the next op."""
    if tp == 1 or not rank.tp_reduce:
        return 0.0
    again = job.checkpointed(rank.stacks, rank.n_blocks)
    per: dict[int, float] = {}
    for r, (forward, backward), twice in zip(where, rank.tp_reduce, again):
        per[r] = per.get(r, 0) + forward * (2 if twice else 1) + backward
    return max(per.values()) * tokens * c * 2 * (tp - 1) / tp / (hw.intra_gbps * 1e9)


def _dp_seconds(plan, rank, hw, c: int, accum: int, pipe: Pipe | None) -> dict[str, float]:
    """Data-parallel traffic per step of the fullest position's parameters (n per TP rank). FSDP2:
    per micro-batch (per chunk in a pipeline) an all-gather of the compute-dtype parameters (zero3:
    again for backward) and a reduce-scatter of fp32 gradients over dp_shard, then HSDP's all-reduce
    of the gradient shard across dp_replicate; hidden under compute as far as it goes. DDP (+ ZeRO-1's
    broadcast): one all-reduce of fp32 gradients, under backward, or after the schedule in a pipeline."""
    n = rank.params if pipe is None else max(_position_params(rank, pipe))
    t = rank.trainable_params if pipe is None else max(_position_params(rank, pipe, True))  # gradients, updates
    # FSDP2 shards over dp_shard x cp and DDP averages over dp x cp (layout/mesh.py): cp sits inside dp_shard
    dps, dpr, out = plan.dp_shard * plan.cp, plan.dp_replicate, {"communication": 0.0}
    if plan.engine == "fsdp":
        m = pipe.layout.chunks if pipe else 1
        gathers = (2 if plan.zero == 3 else 1) * m
        out["communication"] = accum * (gathers * c * n + m * 4 * t) * (dps - 1) / dps / link(hw, plan.tp * dps)
        if dpr > 1:
            shard = 4 * t / dps
            out["communication"] += accum * m * 2 * shard * (dpr - 1) / dpr / link(hw, plan.tp * dps * dpr)
    elif plan.engine == "offload":  # once per step: fp32 gradient rows reduce-scattered, parameters gathered
        out["gradient reduce-scatter"] = (4 + c) * t * (dps - 1) / dps / link(hw, plan.tp * dps)
    elif plan.grad_ranks > 1:
        ranks = plan.grad_ranks
        moved = (2 * 4 * t + (4 * t if plan.zero == 1 else 0)) * (ranks - 1) / ranks / link(hw, plan.tp * ranks)
        out["gradient all-reduce" if pipe else "communication"] = moved
    return out


def _position_params(rank, pipe: Pipe, trainable: bool = False) -> list[float]:
    """Each position's parameters (per TP rank): its stages' blocks and the outside ones it holds;
    `trainable`: only those that train (LoRA: the adapters)."""
    layout, runs = pipe.layout, pipe.runs
    blocks = [n - f for n, f in zip(rank.block_params, rank.blocks_frozen())] if trainable else rank.block_params
    kept = 1 - outside_frozen_share(rank) if trainable else 1
    out = [sum(blocks[g] for s in layout.stages_of(r) for g in range(*runs[s])) for r in range(layout.world)]
    for n, ranks in holders(rank, layout, runs):
        for r in ranks:
            out[r] += n * kept
    return out

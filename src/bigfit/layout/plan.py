"""`ParallelPlan`: how one job spreads its model over processes and devices, as one validated value.

Five degrees multiply to the world size, in the mesh's order (outermost first):
    pp            pipeline positions (torch.distributed.pipelining), each a contiguous run of blocks
    dp_replicate  data-parallel replicas that hold whole copies (DDP; HSDP's outer dimension)
    dp_shard      data-parallel ranks that shard the model states among them (ZeRO-1/2/3)
    cp            context-parallel ranks that split each sequence (they read the same samples; their
                  gradients are reduced, and FSDP2 shards, over dp_shard x cp, as torchtitan does)
    tp            tensor-parallel ranks that split each block's matrices (DTensor)
What the data-parallel ranks shard is the ZeRO stage (0 nothing, 1 optimizer states, 2 + gradients,
3 + parameters), and where the optimizer lives is the offload tier (none, host, nvme). A one-process
job may instead split its model over several devices (`split="device_map"`).

The names users know (`zero3`, `zero2-offload`, `pipeline`, ...) are aliases (`ALIASES`): each says
which kind of data parallelism to use and which degree takes the processes no flag claims.
`plan_for` resolves flags and name into a plan; `__post_init__` refuses any combination bigfit
cannot run, naming every number. torchtitan's `ParallelDims` is the model. Pure: no torch import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..errors import BigfitError

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh's dimensions, outermost first
OFFLOAD_TIERS = ("none", "host", "nvme")


@dataclass(frozen=True)
class Alias:
    zero: int  # ZeRO stage of the data-parallel ranks
    fills: str  # the degree that takes the processes left over by the explicit ones
    offload: str = "none"  # where the optimizer states live
    offload_params: bool = False  # parameters at rest in host RAM too (zero3-offload)
    split: str | None = None  # a one-process split over devices
    one_process: bool = False  # the whole job is one process (which drives every device it has)


ALIASES = {
    "single": Alias(0, "dp_replicate", one_process=True),
    "ddp": Alias(0, "dp_replicate"),
    "zero1": Alias(1, "dp_shard"),
    "zero2": Alias(2, "dp_shard"),
    "zero3": Alias(3, "dp_shard"),
    "zero2-offload": Alias(2, "dp_shard", offload="host"),
    "zero2-offload-nvme": Alias(2, "dp_shard", offload="nvme"),
    "zero3-offload": Alias(3, "dp_shard", offload="host", offload_params=True),
    "pipeline": Alias(0, "pp"),
    "device_map": Alias(0, "dp_replicate", split="device_map", one_process=True),
}


@dataclass(frozen=True)
class ParallelPlan:
    world: int = 1  # processes in the job
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    zero: int = 0  # 0: nothing sharded, 1: optimizer states, 2: + gradients, 3: + parameters
    offload: str = "none"  # none, host (RAM) or nvme: where optimizer states and the update live
    offload_params: bool = False  # parameters at rest in host RAM, copied up per block (zero3-offload)
    split: str | None = None  # "device_map": one process drives every device of a map
    chunks: int = 1  # pipeline micro-batches per micro-batch (pipeline stages, device_map GPipe)
    schedule: str | None = None  # pipeline schedule (gpipe, 1f1b, interleaved) when pp > 1
    stages_per_rank: int = 1  # pipeline stages per position (interleaved: 2 or more)
    sequence_parallel: bool = False  # tp's residual stream, norms and dropout split by sequence (tp > 1)
    checkpointing: bool = False  # activation checkpointing of blocks (all, or the first `checkpoint_blocks`)
    checkpoint_blocks: int | None = None  # how many blocks are checkpointed (the first of each stack); None: all
    offload_activations: bool = False  # checkpointed blocks' inputs kept in host RAM (engine/actoffload.py)
    compile: bool = False  # torch.compile of every block
    name: str = "zero3"  # the alias it was resolved from, for messages and the start-of-run table

    def __post_init__(self):
        degrees = {d: getattr(self, d) for d in DIMS if d != "cp" or self.cp != 1}  # cp named where it is used
        if any(not isinstance(v, int) or v < 1 for v in degrees.values()):
            raise BigfitError(f"parallel degrees must be positive integers, got {_named(degrees)}")
        if self.product != self.world:
            raise BigfitError(f"{_named(degrees)} multiply to {self.product}, but the job has {self.world} "
                              f"processes; choose degrees whose product is {self.world}")
        if self.zero not in (0, 1, 2, 3) or self.offload not in OFFLOAD_TIERS:
            raise BigfitError(f"ZeRO stage {self.zero} / offload {self.offload!r}: valid stages 0-3, tiers "
                              f"{', '.join(OFFLOAD_TIERS)}")
        for problem in _unsupported(self):
            raise BigfitError(problem)

    @property
    def product(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the global batch is divided over these (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_ranks(self) -> int:
        """Ranks whose gradients are reduced together: the data-parallel ones and, since each holds
        part of every sequence, the context-parallel ones."""
        return self.dp * self.cp

    @property
    def engine(self) -> str:
        """Which data-parallel engine runs the update: 'fsdp' (FSDP2), 'ddp' (DDP, optionally with a
        ZeRO-1 optimizer), 'offload' (bigfit's offload engine: zero2 with states in host RAM or
        files), or 'local' (nothing to reduce: one data-parallel rank without FSDP2)."""
        if self.offload != "none" and not self.offload_params:
            return "offload"
        if self.zero >= 2 or self.offload_params:
            return "fsdp"
        return "ddp" if self.grad_ranks > 1 else "local"

    def describe(self) -> str:
        """One line for the start-of-run table: the degrees that are on, and what data parallelism does."""
        on = [f"{d} {getattr(self, d)}" for d in DIMS if getattr(self, d) > 1] or ["1 process"]
        what = {"fsdp": f"ZeRO-{self.zero} (FSDP2)", "ddp": "ZeRO-1 (DDP + sharded optimizer)" if self.zero == 1
                else "DDP", "offload": "ZeRO-2 offload engine", "local": "no data parallelism"}[self.engine]
        extras = [f"optimizer in {'host RAM' if self.offload == 'host' else 'NVMe files'}"] if self.offload != "none" else []
        extras += ["parameters in host RAM"] if self.offload_params else []
        extras += [f"device map, {self.chunks} chunks"] if self.split else []
        extras += [f"pipeline {self.schedule}, {self.chunks} chunks"] if self.pp > 1 else []
        extras += ["sequence parallel"] if self.sequence_parallel else []
        return f"{self.name}: {' x '.join(on)}; {what}" + "".join(f"; {e}" for e in extras)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _named(degrees: dict) -> str:
    return " x ".join(f"{d} {v}" for d, v in degrees.items())


def _unsupported(p: ParallelPlan) -> list[str]:
    """Each combination bigfit cannot run, as the line that says so and what would work."""
    out = []
    if p.zero == 0 and p.dp_shard > 1:
        out.append(f"--dp-shard {p.dp_shard} shards model states, which needs ZeRO stage 1-3 (zero1/zero2/zero3), "
                   f"not {p.name}; use --dp-replicate {p.dp_shard} for plain data parallelism")
    if p.zero == 1 and p.dp_replicate > 1:
        out.append(f"zero1 shards optimizer states over every data-parallel rank: use --dp-shard "
                   f"{p.dp}, not --dp-replicate {p.dp_replicate}")
    if p.engine == "offload" and (p.tp > 1 or p.dp_replicate > 1):
        out.append(f"{p.name}'s offload engine shards over data-parallel ranks only (got tp {p.tp}, dp_replicate "
                   f"{p.dp_replicate}); use zero3-offload for tensor parallel or replicated layouts, or --tp 1")
    if p.offload_params and p.pp > 1 and p.dp == 1:
        # seen on torch 2.13: FSDP2 on a one-rank mesh over stages keeps only the last micro-batch's gradients
        out.append(f"{p.name} over pipeline stages needs 2 or more data-parallel ranks per stage (got pp {p.pp} of "
                   f"{p.world} processes); use --nproc {2 * p.world}, or zero2-offload --pp {p.pp} (each stage's "
                   "optimizer in host RAM)")
    if p.pp > 1 and p.engine == "fsdp" and p.stages_per_rank > 1:
        out.append(f"{p.name} over an interleaved pipeline ({p.stages_per_rank} stages per rank) is not supported "
                   "yet: FSDP2 takes one stage per rank as its root; use --pipeline-schedule 1f1b or gpipe, or ddp")
    if p.tp > 1 and p.zero == 1:
        out.append(f"zero1 with tensor parallelism: use zero2 or zero3 (FSDP2 over TP, got --tp {p.tp})")
    if p.tp > 1 and p.engine == "ddp" and p.pp == 1:
        out.append(f"--tp {p.tp} with --dp-replicate {p.dp_replicate} under {p.name}: DDP does not take tensor-parallel "
                   "(DTensor) parameters; use --strategy zero2 or zero3 (FSDP2 over TP, HSDP with --dp-replicate)")
    if p.sequence_parallel and p.tp == 1:
        out.append("--sequence-parallel splits the sequence over tensor-parallel ranks: add --tp 2 or more")
    if p.sequence_parallel and p.pp > 1:
        out.append(f"--sequence-parallel with --pp {p.pp} is not supported yet (stages exchange whole hidden states); "
                   "use --tp alone or with --dp-shard, or drop --sequence-parallel")
    out += _context_unsupported(p)
    if p.offload_activations and not p.checkpointing:
        out.append("offloaded activations are the checkpointed blocks' inputs: turn checkpointing on (--activations offload)")
    if p.pp == 1 and (p.schedule is not None or p.stages_per_rank != 1):
        given = ", ".join(f for f, on in (("--pipeline-schedule", p.schedule is not None),
                                          ("--stages-per-rank", p.stages_per_rank != 1)) if on)
        out.append(f"{given} belong(s) to a pipeline (--strategy pipeline or --pp 2 or more), not {p.name}")
    if p.chunks > 1 and p.pp == 1 and not p.split:
        out.append(f"--chunks belongs to --strategy device_map or a pipeline (--pp), not {p.name}")
    return out


def _context_unsupported(p: ParallelPlan) -> list[str]:
    """The layouts context parallelism does not compose with yet, each with what would."""
    if p.cp == 1:
        return []
    out = []
    if p.engine == "offload":
        out.append(f"--cp {p.cp} with {p.name}: the offload engine reduces over data-parallel ranks only; use zero2, "
                   "zero3 or zero3-offload (FSDP2 shards over dp_shard x cp)")
    if p.zero == 1:
        out.append(f"--cp {p.cp} with zero1: use zero2 or zero3 (FSDP2 shards over dp_shard x cp)")
    if p.pp > 1:
        out.append(f"--cp {p.cp} with --pp {p.pp} is not supported yet (stages exchange whole sequences); use --cp with "
                   "--dp-shard, --dp-replicate or --tp")
    if p.sequence_parallel:
        out.append("--sequence-parallel with --cp: the sequence is already split over the context-parallel ranks; "
                   "drop --sequence-parallel")
    return out


def plan_for(strategy: str, world: int, *, tp: int | None = None, pp: int | None = None,
             dp_shard: int | None = None, dp_replicate: int | None = None, cp: int | None = None,
             **rest) -> ParallelPlan:
    """The plan of `strategy` (an alias) on `world` processes, with any degree given explicitly.
    The alias's `fills` degree takes what the others leave; an explicit value of it is checked."""
    if strategy not in ALIASES:
        raise BigfitError(f"--strategy {strategy!r} is not valid; choose one of: {', '.join(ALIASES)}")
    alias = ALIASES[strategy]
    if alias.one_process and (cp or 1) > 1:
        raise BigfitError(f"--cp {cp} splits each sequence over processes, but {strategy} runs one process; use "
                          f"--strategy zero3 (or ddp, zero2) with --nproc {cp} or more")
    if alias.one_process and world != 1:
        raise BigfitError(f"strategy {strategy!r} runs one process (which drives every device)" + (
            f": it splits the model over the devices of one process, but the plan has {world} processes; use "
            "--nproc 1, or --pp for a pipeline across processes" if alias.split else
            f", but --nproc is {world}; use --nproc 1, or ddp / zero3 for several processes"))
    given = {"tp": tp, "pp": pp, "dp_shard": dp_shard, "dp_replicate": dp_replicate, "cp": cp}
    for d, v in given.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise BigfitError(f"--{d.replace('_', '-')} must be a positive integer, got {v!r}")
    degrees = {d: v or 1 for d, v in given.items()}
    if given[alias.fills] is None:
        rest_product = math.prod(v for d, v in degrees.items() if d != alias.fills)
        named = {d: v for d, v in degrees.items() if d != alias.fills and (d != "cp" or cp is not None)}
        if world % rest_product:
            raise BigfitError(f"{_named(named)} = {rest_product} "
                              f"does not divide the {world} processes; choose degrees whose product divides {world}")
        degrees[alias.fills] = world // rest_product
    if alias.fills == "pp" and degrees["pp"] < 2:
        raise BigfitError(f"a pipeline runs one process per stage, but the job has {world} process(es) for it; use "
                          "--nproc 2 or more (or device_map, which splits the model over the devices of one process)")
    zero = alias.zero if degrees["dp_shard"] * degrees["dp_replicate"] * degrees["cp"] > 1 or _one_rank_fsdp(
        alias, degrees) else 0
    return ParallelPlan(world=world, **degrees, zero=zero, offload=alias.offload, offload_params=alias.offload_params,
                        split=alias.split, name=strategy, **rest)


def _one_rank_fsdp(alias: Alias, degrees: dict) -> bool:
    """One data-parallel rank keeps its ZeRO stage only where that changes what runs: alone (FSDP2's
    mixed precision and offload on a one-rank mesh, the offload engine) or with offload. Beside
    tensor or pipeline parallelism a one-rank data-parallel dimension has nothing to shard."""
    return (degrees["tp"] == 1 and degrees["pp"] == 1) or alias.offload != "none"


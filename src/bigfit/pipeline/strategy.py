"""`--strategy pipeline`: the split step of parallel/apply.py for pipelines across processes.

Every rank plans the same split on its meta-device copy of the model, prunes it to its own stages,
and only then gets weights: it fills the tensors it kept itself (bigfit.loading: its stages' slices of
the weights files, or the seeded init), so no rank ever holds more than its stages; a 4-bit base's
layers among them (QLoRA) are read and quantized on its device first. On the rank-0
path rank 0's model is real and it sends each other rank just the tensors that rank kept.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..adapters.quantize import describe as describe_4bit, quantize_base
from ..common.distributed import Runtime, gather_objects
from ..common.precision import compute_dtype
from ..layout.cut import PipelineLayout
from ..layout.mesh import run_group
from ..layout.split import Split, plan_split, prune, tied_groups
from ..loading import Weights, fill
from ..loading.materialise import to_empty
from .runner import PipelineApplied
from .stage import StageModule


def layout_of(cfg, positions: int) -> PipelineLayout:
    """The layout over `positions` pipeline ranks (the plan's pp degree)."""
    return PipelineLayout(world=positions, stages_per_rank=cfg.stages_per_rank, schedule=cfg.pipeline_schedule,
                          chunks=cfg.chunks)


def check(cfg, model_config, positions: int) -> str:
    """Every check of the split before any process or weight (on a meta-device model)."""
    from ..models.source import meta_model

    model = meta_model(model_config)
    split = plan_split(model, layout_of(cfg, positions))
    tied_groups(model, split)  # raises for models whose non-block modules cannot be placed
    return describe(split)


def describe(split: Split) -> str:
    parts = []
    for s, (a, b) in enumerate(split.runs):
        first, last = split.where(a), split.where(b - 1)
        name = lambda k, i: f"{split.stacks[k][0]}.{i}"  # noqa: E731
        parts.append(f"stage {s} (rank {split.layout.rank_of(s)}): {name(*first)}" +
                     (f"..{name(*last)}" if b - a > 1 else ""))
    return "; ".join(parts)


def apply_pipeline(model: torch.nn.Module, plan, cfg, rt: Runtime, weights: Weights | None = None) -> PipelineApplied:
    """This rank's stages of the pipeline it belongs to (its `pp` position; data-parallel and
    tensor-parallel peers hold the same stages), filled from `weights`, or with rank 0's weights."""
    layout = layout_of(cfg, plan.pp)
    position = rt.mesh.get_local_rank("pp")
    split = plan_split(model, layout)
    groups = tied_groups(model, split)
    full = _all_tensors(model) if rt.is_main and weights is None else {}
    prune(model, split, layout.stages_of(position))
    stores = quantize_base(model, weights, lambda _: rt.device) if cfg.load_in_4bit else {}  # the kept layers
    if weights is not None:
        fill(model, weights, rt.device)  # the kept tensors only: their names are the unpruned model's
    else:
        _materialise(model, full, rt)
    del full
    mods = [StageModule(model, split, s, compute_dtype(cfg.precision)) for s in layout.stages_of(position)]
    tied = _tied(model, groups, rt)
    notes = [f"pipeline {layout.schedule}, {layout.stages} stages, {layout.chunks} chunks per micro-batch: "
             f"{describe(split)}"] + ([describe_4bit(stores, " of rank 0's stages")] if stores else [])
    if tied:
        notes.append(f"tied across stages (gradients summed each step): {', '.join(g[0][0] for g in groups)}")
    if getattr(model.config, "is_encoder_decoder", False):
        notes.append("evaluation: held-out loss only (generate() needs every stage in one process: use the "
                     "consolidated model)")
    if layout.chunks < layout.stages:
        notes.append(f"only {layout.chunks} chunks for {layout.stages} stages: most stages wait; use --chunks "
                     f"{layout.stages} or more")
    return PipelineApplied(model=model, module=model, strategy=plan.name, notes=notes, stage_modules=mods,
                           layout=layout, tied=tied, device=rt.device, group=rt.mesh.get_group("pp"),
                           ranks_per_position=rt.world_size // plan.pp)


def _all_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by every name (references, not copies), before pruning."""
    out = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    out.update({n: b for n, b in model.named_buffers(remove_duplicate=False)})
    return out


@torch.no_grad()
def _materialise(model: torch.nn.Module, full: dict, rt: Runtime) -> None:
    """Rank 0's values into every rank's kept tensors, by point-to-point sends in a fixed order:
    each rank lists what it kept (one tensor once, under its first name); rank 0 sends exactly that."""
    if rt.is_main:
        model.to(rt.device)
    elif any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        to_empty(model, rt.device)
    mine = _kept(model)
    wanted = gather_objects(list(mine), rt)
    if rt.is_main:
        for rank in range(1, rt.world_size):
            for name in wanted[rank]:
                dist.send(full[name].to(rt.device).contiguous(), dst=rank)
    else:
        for name, t in mine.items():
            buf = torch.empty_like(t)
            dist.recv(buf, src=0)
            t.copy_(buf)


def _kept(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out, seen = {}, set()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _tied(model: torch.nn.Module, groups, rt: Runtime) -> list:
    """(a name of the parameter, its copies' process group, counted here) for the tied groups this rank is in.
    A tied group names pipeline positions; its copies are the ranks at those positions with this
    rank's data- and tensor-parallel coordinates. Every rank creates every group, in the same order
    (new_group is collective)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    grid = rt.mesh.mesh  # ranks by (pp, dp_replicate, dp_shard, tp)
    out = []
    for names, positions in groups:
        for others in grid.flatten(1).unbind(1):  # each combination of the inner coordinates
            ranks = [int(others[p]) for p in positions]
            group = run_group(ranks)  # this run's alone
            if rt.rank in ranks:
                name = next(n for n in names if n in params)
                out.append((name, group, rt.rank == ranks[0]))
    return out

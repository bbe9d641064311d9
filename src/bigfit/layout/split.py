"""Which stage owns which module, and pruning a model down to one rank's stages.

Ownership is found on the full (real or meta) model, the same on every rank:
- a block belongs to the stage whose run of blocks holds it (cut.py);
- outside the blocks, a module with parameters of its own that sits under a stack's parent (GPT-2's
  `transformer`, Llama's `model`, T5's `encoder` / `decoder`) goes with that stack's first block
  if it is an embedding (it runs before the blocks), else with its last block (the final norm);
- anything else with parameters (the head) goes to the last stage. A module reachable under
  several names (T5's `shared` is also both stacks' `embed_tokens`) belongs to every stage that
  uses it. A parameter held on several ranks (tied embeddings) is a tied group, kept in step by
  the runner.

Pruning keeps parameter names: a block stack becomes a ModuleList holding only this rank's blocks
under their original indices (`model.layers.5` stays `model.layers.5`), and every other module this
rank does not own is replaced by a parameterless stand-in. So the state dict of a rank is a subset
of the full model's, DCP writes each piece under its usual name, and a checkpoint consolidates to
a normal full model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import BigfitError
from ..models.source import block_lists, owners
from .cut import PipelineLayout, balance, check_depth


@dataclass
class Split:
    stacks: list[tuple[str, nn.ModuleList]]  # block_lists of the full model, forward order
    runs: list[tuple[int, int]]  # per stage: [start, stop) in the concatenated block order
    layout: PipelineLayout

    @property
    def offsets(self) -> list[int]:
        out, n = [], 0
        for _, blocks in self.stacks:
            out.append(n)
            n += len(blocks)
        return out

    @property
    def n_blocks(self) -> int:
        return sum(len(b) for _, b in self.stacks)

    def stage_of(self, g: int) -> int:
        return next(s for s, (a, b) in enumerate(self.runs) if a <= g < b)

    def where(self, g: int) -> tuple[int, int]:
        """(stack, index in the stack) of global block `g`."""
        k = max(i for i, off in enumerate(self.offsets) if off <= g)
        return k, g - self.offsets[k]


def plan_split(model: nn.Module, layout: PipelineLayout) -> Split:
    stacks = block_lists(model)
    encdec = bool(getattr(model.config, "is_encoder_decoder", False))
    kind = getattr(model.config, "model_type", type(model).__name__)
    if encdec and kind not in ("t5", "mt5"):
        raise BigfitError(f"--strategy pipeline cuts decoder-only models and T5; {kind} is an encoder-decoder it "
                          "does not know how to carry across stages; use device_map (one process) or zero3")
    if len(stacks) != (2 if encdec else 1):
        found = ", ".join(n for n, _ in stacks) or "none"
        raise BigfitError(f"--strategy pipeline: {kind} should have {2 if encdec else 1} block stack(s), found "
                          f"{found}; use device_map or zero3 for this model")
    costs = [sum(p.numel() for p in block.parameters()) for _, blocks in stacks for block in blocks]
    check_depth(len(costs), layout, " + ".join(f"{len(b)} in {n}" for n, b in stacks))
    return Split(stacks, balance(costs, layout.stages), layout)


def _parent(stack_name: str) -> str:
    return stack_name.rsplit(".", 1)[0] if "." in stack_name else ""


def _under(path: str, parent: str) -> bool:
    return parent == "" or path == parent or path.startswith(parent + ".")


def _block_of(path: str, split: Split) -> int | None:
    """The global index of the block that `path` is (or is inside of), else None."""
    for k, (name, blocks) in enumerate(split.stacks):
        if path.startswith(name + "."):
            i = int(path[len(name) + 1:].split(".")[0])
            return split.offsets[k] + i
    return None


def module_stages(model: nn.Module, split: Split) -> dict[int, set[int]]:
    """id(module) -> stages that run it, for modules outside the blocks with parameters of their own."""
    out: dict[int, set[int]] = {}
    last = len(split.runs) - 1
    lone: dict[str, list[str]] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        if not mod._parameters or _block_of(path, split) is not None:
            continue
        stage = last
        for k, (name, blocks) in enumerate(split.stacks):
            if _under(path, _parent(name)):
                first_g, last_g = split.offsets[k], split.offsets[k] + len(blocks) - 1
                if isinstance(mod, nn.Embedding):
                    stage = split.stage_of(first_g)
                else:
                    stage = split.stage_of(last_g)
                    lone.setdefault(name, []).append(path)
                break
        else:
            stage = 0 if isinstance(mod, nn.Embedding) else last
        out.setdefault(id(mod), set()).add(stage)
    for name, paths in lone.items():
        if len(set(paths)) > 1:
            raise BigfitError(f"--strategy pipeline: cannot tell which of {', '.join(sorted(set(paths)))} run before "
                              f"the blocks of {name} and which after; use device_map or zero3 for this model")
    return out


def tied_groups(model: nn.Module, split: Split) -> list[tuple[list[str], list[int]]]:
    """Parameters held on more than one rank: (every name of it, the ranks), in parameter order."""
    stages = module_stages(model, split)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    paths: dict[int, str] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(mod), path)
    groups = []
    for pid, held in owners(model).items():
        ranks = set()
        for mod, _ in held:
            g = _block_of(paths[id(mod)], split)
            where = {split.stage_of(g)} if g is not None else stages.get(id(mod), set())
            ranks |= {split.layout.rank_of(s) for s in where}
        if len(ranks) > 1:
            groups.append((names[pid], sorted(ranks)))
    order = {n: i for i, (n, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    return sorted(groups, key=lambda g: order[g[0][0]])


def anchors(model: nn.Module) -> list[tuple[int, tuple[int, ...], int]]:
    """Each parameter outside the blocks as (its elements, the global indices of the blocks it goes
    with, its rows: what tensor parallelism's vocabulary split divides), whatever the cut: a cut
    puts it on the stages holding those blocks, a copy on each rank (tied). Read off `module_stages`
    over a cut of one block per stage, so the planner places them as training does. Raises
    BigfitError for a model the pipeline cannot cut."""
    n = sum(len(b) for _, b in block_lists(model))
    split = plan_split(model, PipelineLayout(world=max(n, 1), stages_per_rank=1, schedule="gpipe", chunks=1))
    stages = module_stages(model, split)
    out = []
    for held in owners(model).values():
        blocks = set().union(*(stages.get(id(mod), set()) for mod, _ in held))
        if blocks:
            mod, name = held[0]
            p = mod._parameters[name]
            out.append((p.numel(), tuple(sorted(blocks)), p.shape[0] if p.dim() else 1))
    return out


class Elsewhere(nn.Module):
    """Stands in for a module that lives on another stage. No parameters, so this rank's state dict
    holds only what it owns. An embedding's stand-in returns zeros of the right shape: the model's
    own forward still embeds before its blocks on every stage, and the runner swaps the received
    hidden state in at this stage's first block."""

    def __init__(self, name: str, dim: int | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.name, self.dim, self.dtype = name, dim, dtype

    def forward(self, ids, *args, **kwargs):
        if self.dim is None:
            raise RuntimeError(f"bigfit pipeline: {self.name} lives on another stage and should not run here")
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)

    def extra_repr(self) -> str:
        return f"{self.name} on another stage"


def sparse_list(blocks: dict[int, nn.Module]) -> nn.ModuleList:
    """A ModuleList holding only some blocks, under their original indices (names stay the same);
    iterating it runs them in order."""
    out = nn.ModuleList()
    for i in sorted(blocks):
        out.add_module(str(i), blocks[i])
    return out


def prune(model: nn.Module, split: Split, stages: list[int]) -> None:
    """Keep only what `stages` run; stand-ins keep the model's own forward callable."""
    mine = set(stages)
    kept = {m for m, s in module_stages(model, split).items() if s & mine}
    stand_ins: dict[int, Elsewhere] = {}
    for path, mod in list(model.named_modules(remove_duplicate=False)):
        if not mod._parameters or id(mod) in kept or _block_of(path, split) is not None:
            continue
        if id(mod) not in stand_ins:
            emb = isinstance(mod, nn.Embedding)
            stand_ins[id(mod)] = Elsewhere(path, mod.embedding_dim if emb else None, mod.weight.dtype if emb else None)
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, stand_ins[id(mod)])
    for k, (name, blocks) in enumerate(split.stacks):
        parent, _, attr = name.rpartition(".")
        own = {i: b for i, b in enumerate(blocks) if split.stage_of(split.offsets[k] + i) in mine}
        setattr(model.get_submodule(parent), attr, sparse_list(own))

"""A deep model's planning trace runs only the first blocks of each stack (profile.py): the fake-tensor
forward costs the host about 55 ms a Llama-8B block, so an 80-block model took seconds per shape and
`bigfit plan` traces many shapes. Where a stack's blocks after its first are alike (same modules,
parameter shapes and settings, as T5's, GPT-2's and Llama's are: only T5's first block carries the
relative position bias), the trace runs KEEP of them and every later block gets the figures of the
last one that ran. tests/test_planning_shorten.py holds the short trace equal to the whole one."""
from __future__ import annotations

import contextlib

import torch

# blocks run of each stack whose later blocks are alike: the first (it may differ), one that follows
# it, and one that follows a block like itself (what every later block does)
KEEP = 3
# per-block settings that number the block and change nothing else
_NUMBERING = {"layer_idx", "layer_id", "layer_number", "block_idx", "idx"}
_SIMPLE = (bool, int, float, str, type(None))


def kept(stacks: list[tuple[str, torch.nn.ModuleList]]) -> list[int]:
    """How many blocks of each stack the trace runs: KEEP where the rest are alike, else all."""
    out = []
    for _, stack in stacks:
        later = {_signature(blk) for blk in list(stack)[1:]}
        out.append(min(KEEP, len(stack)) if len(later) <= 1 else len(stack))
    return out


@contextlib.contextmanager
def shortened(model: torch.nn.Module, stacks, keep: list[int]):
    """Each stack's ModuleList swapped for one holding its first `keep` blocks, and put back."""
    swapped = []
    for (path, stack), n in zip(stacks, keep):
        if n < len(stack):
            parent, _, name = path.rpartition(".")
            owner = model.get_submodule(parent)
            swapped.append((owner, name, stack))
            setattr(owner, name, torch.nn.ModuleList(list(stack)[:n]))
    try:
        yield
    finally:
        for owner, name, stack in swapped:
            setattr(owner, name, stack)


def widen(values: list, stacks, keep: list[int]) -> list:
    """Per-block figures with the blocks that did not run given their stack's last traced block's."""
    out, start = list(values), 0
    for (_, stack), n in zip(stacks, keep):
        for i in range(start + n, start + len(stack)):
            out[i] = out[start + n - 1]
        start += len(stack)
    return out


def _signature(block: torch.nn.Module) -> tuple:
    modules = tuple((name, type(m).__name__, _settings(m)) for name, m in block.named_modules())
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters())
    return modules, params


def _settings(m: torch.nn.Module) -> tuple:
    return tuple(sorted((k, v) for k, v in vars(m).items()
                        if not k.startswith("_") and k not in _NUMBERING and isinstance(v, _SIMPLE)))

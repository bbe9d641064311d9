"""Device maps: which device each transformer block lives on, parsed and checked before anything moves.

The user's form is the seed discussion's, a list of block indices per device, one map per block stack:

    {"encoder": {"cuda:0": [0, 1, 2, 3, 4, 5]},            # flat: the encoder on one device...
     "decoder": {"cuda:1": [0, 1, 2, 3, 4, 5, 6, 7, 8]},   # ...a deeper decoder on another
     "lm_head": "cuda:1",                                   # optional: a non-block module elsewhere
     "main_device": "cuda:0"}                               # optional: where the other modules live

A stack is named by its top-level part (`encoder`, `decoder`, `transformer`, `model`) or its path
(`encoder.block`); a model with one stack may give its map alone: `{"cuda:0": [0, 1], "cpu": [2, 3]}`.
Devices are `cpu`, `cuda:N` (or just N), and `cpu:N`: a *virtual* device, a separate placement in
host memory that bigfit treats as a device of its own (copies to it are real copies and are counted,
chunks are scheduled over it), so that splits, copy counts and pipelines can be tested on a CPU.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..errors import BigfitError

RESERVED = ("main_device",)


@dataclass(frozen=True)
class Stack:
    name: str  # what maps call it: the top-level part (encoder) or, if two stacks share one, the path
    path: str  # module path of its ModuleList (encoder.block)
    size: int  # blocks


def name_stacks(found: list[tuple[str, int]]) -> list[Stack]:
    """Stacks from (path, blocks): named by their top-level part, or by their path when two share one."""
    tops = [p.split(".")[0] for p, _ in found]
    return [Stack(name=top if tops.count(top) == 1 else p, path=p, size=n) for top, (p, n) in zip(tops, found)]


@dataclass(frozen=True)
class DeviceMap:
    stacks: tuple[Stack, ...]
    blocks: dict[str, tuple[str, ...]]  # stack name -> device of each block, in index order
    main_device: str  # embeddings, final norms, heads and everything else not named below
    modules: dict[str, str] = field(default_factory=dict)  # non-block module path -> device

    def device_of(self, stack: str, index: int) -> str:
        return self.blocks[stack][index]

    def devices(self) -> list[str]:
        """Every device used, main first, then in execution order."""
        out = [self.main_device]
        for s in self.stacks:
            out += [d for d in self.blocks[s.name] if d not in out]
        return out + [d for d in self.modules.values() if d not in out]

    def hops(self) -> int:
        """Device changes along the blocks in execution order, counting leaving and re-entering main."""
        path = [self.main_device] + [d for s in self.stacks for d in self.blocks[s.name]] + [self.main_device]
        return sum(a != b for a, b in zip(path, path[1:]))

    def to_json(self) -> dict:
        """The user form, which `resolve_map` reads back to an equal map."""
        out: dict = {}
        for s in self.stacks:
            per: dict[str, list[int]] = {}
            for i, d in enumerate(self.blocks[s.name]):
                per.setdefault(d, []).append(i)
            out[s.name] = per
        return {**out, **self.modules, "main_device": self.main_device}

    def describe(self) -> str:
        parts = []
        for s in self.stacks:
            runs, devs = [], self.blocks[s.name]
            start = 0
            for i in range(1, len(devs) + 1):
                if i == len(devs) or devs[i] != devs[start]:
                    runs.append(f"{start}-{i - 1}" if i - 1 > start else f"{start}")
                    runs[-1] += f" -> {devs[start]}"
                    start = i
            parts.append(f"{s.name} " + ", ".join(runs))
        extra = "".join(f"; {m} -> {d}" for m, d in self.modules.items())
        return "; ".join(parts) + extra + f"; other modules on {self.main_device}"


def canonical_device(device) -> str:
    """'cpu' | 'cpu:N' (N >= 1, virtual) | 'cuda:N'; ints and digit strings are CUDA indices."""
    if isinstance(device, torch.device):
        device = str(device)
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"
    if isinstance(device, str):
        text = device.strip().lower()
        text = f"cuda:{text}" if text.isdigit() else "cuda:0" if text == "cuda" else text
        m = re.fullmatch(r"(cpu|cuda):(\d+)", text)
        if text == "cpu" or (m and text == "cpu:0"):
            return "cpu"
        if m:
            return f"{m.group(1)}:{int(m.group(2))}"
    raise BigfitError(f"{device!r} is not a device; write cpu, cuda:N (or N), or cpu:N (a virtual CPU device)")


def check_device(device: str) -> None:
    """A CUDA device must exist here; CPU placements always do."""
    if device.startswith("cuda:"):
        n = torch.cuda.device_count()
        if int(device.split(":")[1]) >= n:
            have = ", ".join([f"cuda:{i}" for i in range(n)] + ["cpu"])
            raise BigfitError(f"device {device} does not exist; this machine has: {have}")


def real_device(device: str) -> torch.device:
    """The torch device behind a placement: virtual cpu:N devices are the CPU."""
    return torch.device("cpu") if device.startswith("cpu") else torch.device(device)


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def _stack_by_key(key: str, stacks: tuple[Stack, ...]) -> Stack:
    for s in stacks:
        if key in (s.name, s.path):
            return s
    have = ", ".join(f"{s.name} ({s.path}, {s.size} blocks)" for s in stacks)
    raise BigfitError(f"the device map names stack {key!r}, which this model does not have; its stacks: {have}")


def _indices(stack: Stack, per_device: dict) -> tuple[str, ...]:
    """Device of each block of `stack` from {device: [indices]}: every block exactly once."""
    if not isinstance(per_device, dict) or not per_device:
        raise BigfitError(f"the map of stack {stack.name!r} must be {{device: [block indices]}}, got {per_device!r}")
    owner: dict[int, str] = {}
    for raw_dev, idx in per_device.items():
        dev = canonical_device(raw_dev)
        if not isinstance(idx, (list, tuple, range)):
            raise BigfitError(f"stack {stack.name!r}, device {dev}: give a list of block indices, got {idx!r}")
        for i in idx:
            if isinstance(i, bool) or not isinstance(i, int):
                raise BigfitError(f"stack {stack.name!r}, device {dev}: block index {i!r} is not an integer")
            if not 0 <= i < stack.size:
                raise BigfitError(f"stack {stack.name!r} has blocks 0..{stack.size - 1}; the map names block {i} "
                                  f"(on {dev}), which does not exist")
            if i in owner:
                raise BigfitError(f"block {i} of stack {stack.name!r} is mapped twice ({owner[i]} and {dev}); "
                                  "give each block one device")
            owner[i] = dev
    missing = [i for i in range(stack.size) if i not in owner]
    if missing:
        raise BigfitError(f"the map of stack {stack.name!r} misses block(s) {', '.join(map(str, missing))}; "
                          f"it has blocks 0..{stack.size - 1} and each needs a device")
    return tuple(owner[i] for i in range(stack.size))


def _split(spec: dict, stacks: tuple[Stack, ...]) -> tuple[dict, dict, object]:
    """(stack maps, module overrides, main_device) from the user's dict."""
    flat = {k: v for k, v in spec.items() if isinstance(v, (list, tuple, range))}
    per_stack = {k: v for k, v in spec.items() if isinstance(v, dict)}
    modules = {k: v for k, v in spec.items() if k not in flat and k not in per_stack and k not in RESERVED}
    if flat:
        if len(stacks) != 1:
            have = ", ".join(f"{s.name}: {s.size} blocks" for s in stacks)
            raise BigfitError(f"this model has {len(stacks)} block stacks ({have}); give one map per stack, like "
                              f"{{{', '.join(repr(s.name) + ': {...}' for s in stacks)}}}")
        if per_stack:
            raise BigfitError("the device map mixes a bare {device: [indices]} map with per-stack maps; use one form")
        per_stack = {stacks[0].name: flat}
    return per_stack, modules, spec.get("main_device")


def resolve_map(spec: dict, stacks: tuple[Stack, ...], main_device=None, module_names=None,
                check_devices: bool = True) -> DeviceMap:
    """The checked DeviceMap of a user map; raises BigfitError naming the first bad entry.
    `module_names`: the model's module paths (for overrides); None skips that check. Planning for
    another machine passes check_devices=False (its GPUs need not exist here)."""
    if not isinstance(spec, dict):
        raise BigfitError(f"a device map is a dict like {{'cuda:0': [0, 1], 'cpu': [2, 3]}}, got {type(spec).__name__}")
    per_stack, modules, spec_main = _split(spec, stacks)
    blocks = {}
    for key, per_device in per_stack.items():
        s = _stack_by_key(key, stacks)
        if s.name in blocks:
            raise BigfitError(f"stack {s.name!r} is mapped twice (as {s.name!r} and {s.path!r})")
        blocks[s.name] = _indices(s, per_device)
    for s in stacks:
        if s.name not in blocks:
            raise BigfitError(f"the device map places no block of stack {s.name!r} ({s.path}, {s.size} blocks); "
                              "map every stack")
    overrides = {}
    for name, dev in modules.items():
        if module_names is not None and name not in module_names:
            raise BigfitError(f"the device map places module {name!r}, which this model does not have (nor is it a "
                              f"stack: {', '.join(s.name for s in stacks)})")
        overrides[name] = canonical_device(dev)
    main = main_device if main_device is not None else spec_main
    main = canonical_device(main) if main is not None else blocks[stacks[0].name][0]
    out = DeviceMap(stacks=stacks, blocks=blocks, main_device=main, modules=overrides)
    for d in out.devices() if check_devices else ():
        check_device(d)
    return out

"""`parallelize` / `deparallelize`: place an unmodified model's blocks by a device map and keep its
forward working with reversible forward hooks (no model class is changed, no forward is replaced).

- Each block moves its tensor inputs to its device before it runs (one copy per tensor and device,
  see moves.py). Its outputs stay where they were made, so the next block on the same device gets
  them for free; the last block of a stack sends its first output (the hidden state, by the
  convention every Hugging Face block follows) back to the main device, where the final norm is.
- Every other module lives on the main device (or where the map names it) and moves what it is given
  there, so an output left behind (T5's position bias, attention maps) is fetched only if used.
- Caches are not tensors the hooks touch: each layer's keys and values are made on its device by the
  layer and stay there; `generate()` reorders beams per layer where the cache lives.
- Tied parameters stay one parameter: a map that would put one on two devices is refused.
- A 4-bit weight (QLoRA, adapters/quantize.py) is made on its device before the rest moves, and stays there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..adapters.quantize import is_quantized
from ..errors import BigfitError
from ..layout.maps import DeviceMap, Stack, canonical_device, name_stacks, real_device, resolve_map
from ..models.source import block_lists, owners
from ..planning.automap import auto_map
from .moves import move, move_tree, settle, tag_tree
from .schedule import reached

ATTR = "_bigfit_layout"


@dataclass
class Layout:
    """What `parallelize` did, kept on the model until `deparallelize` undoes it."""

    device_map: DeviceMap
    handles: list = field(default_factory=list)
    original_device: str | None = None

    @property
    def main(self) -> str:
        return self.device_map.main_device

    @property
    def cpu_default(self) -> str:
        """Where an untagged CPU tensor lives: the main device if that is a CPU placement."""
        return self.main if self.main.startswith("cpu") else "cpu"

    def enter(self, place: str, tree):
        """Inputs to `place`; in a chunked run, a change of device lets other micro-batches go first."""
        args, kwargs = move_tree(tree, place, self.cpu_default)
        hidden = reached(place, tree, _first(args))
        settle()
        return ((hidden, *args[1:]) if hidden is not None else args), kwargs

    def leave(self, output):
        """The first output back to the main device (the hidden state every block returns first)."""
        first = _first(output)
        if first is None:
            reached(self.main)
            settle()
            return output
        hidden = reached(self.main, first, move(first, self.main, self.cpu_default))
        settle()
        return hidden if isinstance(output, torch.Tensor) else type(output)([hidden, *output[1:]])


def _first(obj) -> torch.Tensor | None:
    """The hidden state: the tensor itself, or the first item of a tuple or list (Hugging Face blocks
    take it first and return it first)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if type(obj) in (tuple, list) and obj and isinstance(obj[0], torch.Tensor):
        return obj[0]
    return None


def find_stacks(model: torch.nn.Module, paths=None) -> list[tuple[Stack, torch.nn.Module]]:
    """The block stacks: `models.block_lists` (the longest ModuleList of one class under each
    top-level part), or the ModuleLists at `paths` for models it does not fit."""
    if paths is None:
        found = block_lists(model)
    else:
        found = []
        for p in paths:
            try:
                mod = model.get_submodule(p)
            except AttributeError:
                raise BigfitError(f"stacks: model has no module {p!r}") from None
            if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) or not len(mod):
                raise BigfitError(f"stacks: {p!r} is a {type(mod).__name__}, not a non-empty ModuleList of blocks")
            found.append((p, mod))
    if not found:
        raise BigfitError(f"found no block stack in {type(model).__name__}; name them with stacks=[...]")
    return list(zip(name_stacks([(p, len(m)) for p, m in found]), (m for _, m in found)))


def _placements(model, dmap: DeviceMap, stacks) -> tuple[dict[str, str], dict[str, str]]:
    """({placed module path: device} for blocks and named modules, {path: device} of every module)."""
    placed = {f"{s.path}.{i}": dmap.device_of(s.name, i) for s, _ in stacks for i in range(s.size)}
    block_paths = set(placed)
    for name, dev in dmap.modules.items():
        if any(name == b or name.startswith(b + ".") for b in block_paths):
            raise BigfitError(f"the device map places {name!r}, which is (part of) a block; blocks are placed "
                              "by their stack's map")
        if any(b.startswith(name + ".") for b in block_paths):
            raise BigfitError(f"the device map places {name!r}, which holds blocks; map its stack instead")
        placed[name] = dev
    every = {}
    for path, _ in model.named_modules():
        owner = max((p for p in placed if path == p or path.startswith(p + ".")), key=len, default=None)
        every[path] = placed[owner] if owner else dmap.main_device
    return placed, every


def module_devices(model, dmap: DeviceMap) -> dict[str, str]:
    """{module path: the device the map puts it on} for every module of `model`."""
    return _placements(model, dmap, find_stacks(model))[1]


def _check_ties(model, every: dict[str, str]) -> None:
    """A parameter or buffer reachable from modules on two devices (tied embeddings) is an error."""
    seen: dict[int, tuple[str, str]] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        for name, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is None:
                continue
            full = f"{path}.{name}" if path else name
            first = seen.setdefault(id(t), (full, every.get(path, "?")))
            if first[1] != every.get(path, first[1]):
                raise BigfitError(f"{full} is tied to {first[0]} (one tensor), but the map puts them on "
                                  f"{every[path]} and {first[1]}; place the modules that share it on one device")


def _move(model, placed: dict[str, str], main: str) -> None:
    """Blocks and named modules to their devices, then the rest, module by module (never the whole
    model to one device first: it may not fit there). A meta-device model gets empty storage on each
    module's device instead, to be filled there (bigfit.loading), with tied parameters kept tied."""
    held = owners(model)
    for path, dev in placed.items():
        for mod in model.get_submodule(path).modules():
            _apply_one(mod, _to(real_device(dev)))
    inside = {id(m) for p in placed for m in model.get_submodule(p).modules()}
    for mod in model.modules():
        if id(mod) not in inside:
            _apply_one(mod, _to(real_device(main)))
    for refs in held.values():  # `_apply` gives a meta parameter a new Parameter in each module holding it
        first = refs[0][0]._parameters[refs[0][1]]
        for mod, name in refs[1:]:
            mod._parameters[name] = first


def _apply_one(mod: torch.nn.Module, fn) -> None:
    """`fn` on the module's own tensors, a 4-bit weight left where it was made (Module._apply would
    make a plain Parameter of bitsandbytes' or swap torchao's, losing what quantizes them)."""
    four = {k: p for k, p in mod._parameters.items() if p is not None and is_quantized(p)}
    if not four:
        mod._apply(fn, recurse=False)
        return
    order = list(mod._parameters)
    for k in four:
        del mod._parameters[k]
    mod._apply(fn, recurse=False)
    mod._parameters.update(four)
    for k in order:  # the original order: state dicts and named_parameters list them as before
        mod._parameters[k] = mod._parameters.pop(k)


def _to(device):
    return lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device)


def _hook_targets(model, placed: dict[str, str]) -> list[tuple[str, torch.nn.Module]]:
    """The outermost modules outside every placed subtree that hold no placed module: embeddings,
    final norms, heads. They move their inputs to where they live."""
    ancestors = {p.rsplit(".", i)[0] for p in placed for i in range(1, p.count(".") + 1)} | {""}
    out = []
    for path, mod in model.named_modules():
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        inside = any(path == p or path.startswith(p + ".") for p in placed)
        if path and not inside and path not in ancestors and parent in ancestors:
            out.append((path, mod))
    return out


def parallelize(model: torch.nn.Module, device_map, main_device=None, *, stacks=None, budgets=None,
                job=None) -> DeviceMap:
    """Spread `model` over devices by `device_map` (see layout/maps.py for its form, or "auto" with
    `budgets` like {"cuda:0": "8GB", "cpu": "64GB"} and an optional planning Job). Everything is
    checked before anything moves. Returns the resolved map."""
    if ATTR in model.__dict__:
        raise BigfitError("this model is already parallelized; call deparallelize(model) first")
    found = find_stacks(model, stacks)
    stack_defs = tuple(s for s, _ in found)
    if isinstance(device_map, str) and device_map == "auto":
        device_map = auto_map(model, found, budgets, job, main_device)
    names = {p for p, _ in model.named_modules()}
    dmap = resolve_map(device_map, stack_defs, main_device, names)
    placed, every = _placements(model, dmap, found)
    _check_ties(model, every)
    devices = {f"{t.device.type}:{t.device.index or 0}" if t.is_cuda else "cpu"
               for t in [*model.parameters(), *model.buffers()]}
    layout = Layout(dmap, original_device=devices.pop() if len(devices) == 1 else None)
    _move(model, placed, dmap.main_device)
    last = {f"{s.path}.{s.size - 1}" for s in stack_defs}
    for path, dev in placed.items():
        mod = model.get_submodule(path)
        layout.handles.append(mod.register_forward_pre_hook(_pre(layout, dev), with_kwargs=True))
        layout.handles.append(mod.register_forward_hook(_post(layout, dev, path in last or path in dmap.modules)))
    for _, mod in _hook_targets(model, placed):
        layout.handles.append(mod.register_forward_pre_hook(_pre(layout, dmap.main_device), with_kwargs=True))
    model.__dict__[ATTR] = layout
    return dmap


def _pre(layout: Layout, place: str):
    def hook(module, args, kwargs):
        return layout.enter(place, (args, kwargs))
    return hook


def _post(layout: Layout, place: str, back_to_main: bool):
    def hook(module, args, output):
        tag_tree(output, place)
        if back_to_main and place != layout.main:
            return layout.leave(output)
        return output
    return hook


def layout_of(model: torch.nn.Module) -> Layout | None:
    return model.__dict__.get(ATTR)


def deparallelize(model: torch.nn.Module, device=None) -> torch.nn.Module:
    """Remove every hook and put the whole model on one device: `device`, else the one it was on
    before `parallelize`, else the main device. The model is then as it was (same modules, forwards,
    parameters and ties)."""
    layout = model.__dict__.pop(ATTR, None)
    if layout is None:
        raise BigfitError("this model is not parallelized (parallelize(model, device_map) was not called on it)")
    for h in layout.handles:
        h.remove()
    target = canonical_device(device) if device is not None else layout.original_device or layout.main
    return model.to(real_device(target))

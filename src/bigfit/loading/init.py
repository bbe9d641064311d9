"""Random init, one unit at a time, for models built from their config (and the buffers a
checkpoint does not hold): Hugging Face's own `_init_weights`, on full-size temporaries of one
unit's tensors on this rank's device, under a generator seeded from (seed, the unit's name).

A unit is a transformer block (models.block_lists), or the rest of the model (embeddings, final
norms, head, rotary tables) with the blocks left out. Units, not single modules, because HF's init of
a module may write its children's tensors (T5's attention its q/k/v/o, GPT-2's attention and MLP
their c_proj, T5's root its shared embedding and head); within a unit the modules are initialised
children first, each by the `_init_weights` of its nearest PreTrainedModel, as HF's own
`initialize_weights` does, so the values follow HF's distributions (GPT-2's scaled c_proj, T5's
factors, Llama's normal, padding rows zero) and tied weights are written once. Each unit's values
depend only on the seed, its name and the device type, never on the layout or the rank count: a
multi-rank run starts from the same weights as one process on the same kind of device.
"""
from __future__ import annotations

import contextlib
import zlib

import torch
from transformers import PreTrainedModel

from ..adapters.lora import ADAPTER, is_lora_layer
from ..models.source import block_lists

try:  # transformers 5: init functions that skip tensors marked initialised, and a guard for torch's
    from transformers import initialization
except ImportError:  # 4.x initialises in place with torch's own functions
    initialization = None


def unit_seed(seed: int, unit: str) -> int:
    """A seed per (seed, unit name), the same in every process (Python's hash() is salted)."""
    return (seed * 0x9E3779B1 + zlib.crc32(unit.encode())) % (1 << 63)


class SeededInit:
    """Values of a meta-device `skeleton`'s tensors, made one unit at a time on `device` and kept
    until a tensor of another unit is asked for (units come in order, so each is made once).
    `params` False: buffers only (a checkpoint gave the parameters), parameters left untouched; a set
    of names: those parameters too (LoRA adapters beside a checkpoint's base weights). LoRA layers
    (peft's) get peft's own init after HF's: lora_A Kaiming-uniform from the unit's generator,
    lora_B zeros, so a fresh adapter leaves the model's output as the base's."""

    def __init__(self, skeleton: torch.nn.Module, seed: int, device, params: bool | set[str] = True):
        self.skeleton, self.seed, self.device, self.params = skeleton, seed, torch.device(device), params
        self.blocks = [f"{stack}.{i}" for stack, mods in block_lists(skeleton) for i in range(len(mods))]
        self._unit, self._values = None, {}

    def unit_of(self, name: str) -> str:
        return next((b for b in self.blocks if name.startswith(b + ".")), "")

    def order(self, name: str) -> int:
        """The place of the tensor's unit: the rest first, then the blocks in order."""
        unit = self.unit_of(name)
        return self.blocks.index(unit) + 1 if unit else 0

    def tensor(self, name: str) -> torch.Tensor:
        """The full initial value of the tensor `name` (any of its names), on the device."""
        unit = self.unit_of(name)
        if unit != self._unit:
            self._values = {}  # the previous unit's temporaries go before this one's are made
            self._unit, self._values = unit, self._make(unit)
        return self._values[name]

    @torch.no_grad()
    def _make(self, unit: str) -> dict[str, torch.Tensor]:
        root = self.skeleton.get_submodule(unit) if unit else self.skeleton
        order = list(_post_order(root, unit, _owner(self.skeleton, unit), set() if unit else set(self.blocks)))
        made = {}  # id(meta tensor) -> its temporary: tied tensors share one
        swapped = [(mod, kind, attr, t) for _, mod, kind, attr, t in _tensors(order, self.params)]
        for mod, kind, attr, t in swapped:
            if id(t) not in made:
                made[id(t)] = _temporary(t, self.device)
            getattr(mod, kind)[attr] = made[id(t)]
        try:
            with _seeded(unit_seed(self.seed, unit), self.device), _guard():
                for _, mod, owner in order:
                    owner._init_weights(mod)
                    if is_lora_layer(mod):  # after its lora_A / lora_B, which HF's init drew as linears
                        mod.reset_lora_parameters(ADAPTER, True)
        finally:
            for mod, kind, attr, t in swapped:
                getattr(mod, kind)[attr] = t
        return {name: made[id(t)].detach() for name, _, _, _, t in _tensors(order, True) if id(t) in made}


def _tensors(order, params: bool | set[str]):
    """(name, module, "_parameters" or "_buffers", attribute, tensor) of the unit's modules' own
    tensors: the buffers, and the parameters `params` asks for (all, none, or those named)."""
    for path, mod, _ in order:
        for kind in ("_parameters", "_buffers"):
            for attr, t in getattr(mod, kind).items():
                name = f"{path}.{attr}" if path else attr
                wanted = kind == "_buffers" or params is True or (params is not False and name in params)
                if t is not None and wanted:
                    yield name, mod, kind, attr, t


def _temporary(t: torch.Tensor, device) -> torch.Tensor:
    """Storage for `t` on the device: zeros, not garbage, in whatever HF's init leaves alone (it
    leaves nothing of the three families' tensors)."""
    z = torch.zeros(t.shape, dtype=t.dtype, device=device)
    return torch.nn.Parameter(z, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else z


def _owner(model: torch.nn.Module, path: str):
    """The PreTrainedModel whose `_init_weights` initialises the module at `path` (HF dispatches
    each sub-model, such as T5's stacks, to its own)."""
    owner, mod = model, model
    for part in path.split(".") if path else ():
        mod = getattr(mod, part)
        if isinstance(mod, PreTrainedModel):
            owner = mod
    return owner


def _post_order(mod, path: str, owner, skip: set[str]):
    """(path, module, its initialiser) for the unit's modules, children first, leaving out `skip`."""
    owner = mod if isinstance(mod, PreTrainedModel) else owner
    for name, child in mod.named_children():
        child_path = f"{path}.{name}" if path else name
        if child_path not in skip:
            yield from _post_order(child, child_path, owner, skip)
    yield path, mod, owner


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device):
    """HF's init draws from torch's default generators: seed this device's (and the CPU's, which
    CPU tensors use), and give both back their state afterwards, so nothing else's randomness moves."""
    gens = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gens.append(torch.cuda.default_generators[index])
    states = [g.get_state() for g in gens]
    for g in gens:
        g.manual_seed(seed)
    try:
        yield
    finally:
        for g, state in zip(gens, states):
            g.set_state(state)


def _guard():
    """Modules that call torch.nn.init directly go through HF's versions, as in its own init (5.x)."""
    guard = getattr(initialization, "guard_torch_init_functions", None)
    return guard() if guard else contextlib.nullcontext()

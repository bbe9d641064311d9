"""Imports point one way: every module of src/bigfit imports only from its own package or from packages
below it in ORDER, at module level and inside functions alike (a function-local import that reaches
up only hides a function that lives in the wrong place), so no two packages import each other; and no
two classes share a name. Read with ast, nothing imported: well under a second."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "bigfit"

# Bottom to top. A package (or a module at the top of src/bigfit) is one layer; "bigfit" is the
# package's own __init__.py and __main__.py. A new package goes where its imports put it.
ORDER = [
    "errors",         # BigfitError: the user's mistake, raised anywhere
    "common",         # what a launcher and its workers agree on, torch.distributed, faults, waits, units, precision
    "settings",       # TrainConfig, reading settings, user files, DeepSpeed configs: no torch
    "kernels",        # host kernels built from C (the offload engine's Adam step)
    "machine",        # hardware, GPUs by name, the figures measured on this machine
    "data",           # reading and tokenizing data
    "models",         # finding and building the model, its tokenizer
    "adapters",       # LoRA, 4-bit bases
    "layout",         # the parallel plan, mesh, pipeline cut and split, device maps: pure layout
    "tensor",         # tensor parallelism's plans and styles (the planner traces them)
    "context",        # context parallelism: sequences split over ranks, attention over the whole sequence
    "loading",        # per-rank loading
    "outputs",        # checkpoint directories, run directories, consolidation
    "planning",       # the planner, device maps' balancer and auto map
    "engine",         # the protocol the loop talks to, per-block transforms
    "data_parallel",  # FSDP2, DDP + ZeRO-1, zero3-offload's streamed steps
    "offload",        # the offload engine
    "optim",          # OffloadAdamW: the offload engine's host step as a torch optimizer
    "pipeline",       # pipeline parallelism
    "device_map",     # device-map model parallelism
    "parallel",       # the transforms of a plan, in order (apply.py)
    "job",            # the resolved job: checks, resolution, prepare, what auto asks the planner
    "training",       # the loop, step, evaluation, checkpoints, metrics, the in-worker probe
    "commands",       # what train / plan run once parsed, micro-batch auto's launcher side
    "userloop",       # bigfit inside the user's own loop: prepare, its engine, launch, Trainer and TRL
    "bench",          # bigfit bench
    "cli",            # the parsers and dispatch
    "api",            # bigfit from Python
    "hf",             # bigfit.hf: Trainer and TRL on bigfit (userloop/hf.py)
    "bigfit",         # the package's __init__ and __main__
]
RANK = {name: i for i, name in enumerate(ORDER)}


def layer(module: str) -> str:
    parts = module.split(".")
    return "bigfit" if len(parts) == 1 or parts[1] == "__main__" else parts[1]


def modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(("bigfit", *path.relative_to(SRC).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = path
    return out


@functools.cache  # both tests read every module once
def imports(module: str, path: Path) -> tuple:
    return tuple(_imports(module, path))


def _imports(module: str, path: Path):
    """(line, imported module, 'function' or 'module') for each bigfit import in `path`."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        where = "module" if id(node) in top else "function"
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "bigfit":
                    yield node.lineno, a.name, where
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "bigfit":
                continue
            for a in node.names:  # `from . import x`: the module x, whose layer may differ from ours
                yield node.lineno, target if node.module or target != "bigfit" else f"bigfit.{a.name}", where


def test_every_import_points_down():
    mods = modules()
    unknown = sorted({layer(m) for m in mods} - set(RANK))
    assert not unknown, f"packages not in ORDER (tests/test_layering.py): {unknown}; add each where its imports put it"
    bad = []
    for module, path in sorted(mods.items()):
        here = layer(module)
        for line, target, where in imports(module, path):
            there = layer(target)
            if there != here and RANK.get(there, -1) > RANK[here]:
                bad.append(f"{path.relative_to(SRC.parent)}:{line} ({where} level) imports {target}: "
                           f"{here} is below {there} in ORDER")
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_no_two_packages_import_each_other():
    mods = modules()
    edges: dict[tuple[str, str], str] = {}
    for module, path in mods.items():
        for line, target, _ in imports(module, path):
            a, b = layer(module), layer(target)
            if a != b:
                edges.setdefault((a, b), f"{path.relative_to(SRC.parent)}:{line} imports {target}")
    mutual = sorted(f"{a} <-> {b}: {edges[a, b]}; {edges[b, a]}" for a, b in edges if a < b and (b, a) in edges)
    assert not mutual, "packages that import each other:\n" + "\n".join(mutual)


def test_no_two_classes_share_a_name():
    """A class is found by its name: two of one name in different modules (two `Job`s, two `Plan`s)
    leave a reader to ask which one a signature means."""
    where: dict[str, list[str]] = {}
    for module, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module)
    shared = sorted(f"{name}: {', '.join(mods)}" for name, mods in where.items() if len(mods) > 1)
    assert not shared, "class names defined more than once:\n" + "\n".join(shared)

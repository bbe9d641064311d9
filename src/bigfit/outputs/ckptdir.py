"""Checkpoints on disk: their names (OUTPUT/checkpoints/step-N, COMPLETE last), the newest one,
what is damaged in one (its manifest, manifest.py), and the trainer.json they hold. Saving and
loading them is checkpoint.py's."""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import BigfitError
from . import manifest

MARKER = "COMPLETE"
NAME = re.compile(r"^step-(\d+)$")


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and NAME.match(path.name) is not None and (path / MARKER).is_file()


def step_of(path: Path) -> int:
    return int(NAME.match(path.name).group(1))


def steps(root: Path) -> list[Path]:
    """Every step-N directory under `root`, newest first: only complete saves are renamed to that
    name, so one without an intact marker was damaged after it was written."""
    found = [p for p in root.glob("step-*") if p.is_dir() and NAME.match(p.name)] if root.is_dir() else []
    return sorted(found, key=step_of, reverse=True)


def damage(path: Path) -> str | None:
    """What is wrong with checkpoint `path` (its marker, or a file its manifest lists), or None. A
    checkpoint whose marker holds no manifest is refused too: every form of marker is verified."""
    marker = path / MARKER
    if not marker.is_file():
        return f"it has no {MARKER} marker"
    body = manifest.unseal(marker.read_text(errors="replace"))
    if body is not None and "files" not in body:  # the older form, {"step": 2, "world_size": 1}
        return (f"its {MARKER} marker holds no manifest of its files (an older bigfit's, or not bigfit's), so "
                "nothing in it can be verified and it is not read")
    if body is None or not manifest.well_formed(body["files"]):
        return f"its {MARKER} marker is damaged"
    return manifest.first_problem(path, body["files"], MARKER)


def verify(path: Path, retry: str) -> None:
    """Raise a BigfitError naming what is damaged in checkpoint `path` and the newest older intact
    checkpoint beside it, which `retry` (a command with {} for the path) would use instead."""
    problem = damage(path)
    if problem is None:
        return
    older = next((p for p in steps(path.parent) if step_of(p) < step_of(path) and damage(p) is None), None)
    instead = f"the newest intact one is {str(older)!r}: {retry.format(older)}" if older else "no older intact one is there"
    raise BigfitError(f"checkpoint {str(path)!r} is damaged: {problem}; {instead}")


def trainer_state(path: Path) -> dict:
    """trainer.json of checkpoint `path` (step, world size, settings, run identity)."""
    try:
        return json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError) as e:  # only a checkpoint without a manifest gets this far damaged
        raise BigfitError(f"checkpoint {str(path)!r}: its trainer.json cannot be read ({e})") from None


def frozen_record(in_checkpoint: bool, model: str | None, device_type: str) -> dict:
    """trainer.json's "frozen": whether the checkpoint holds its frozen parameters, and if not (a LoRA
    run's base) where they come from, as every start of the run made them: `model` (its --model, a
    path made absolute, for a consolidation run elsewhere; None: the default model), the seed in its
    config, and `device_type`, the device the seeded init ran on (its values depend on it)."""
    if model and Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    return {"in_checkpoint": in_checkpoint, "source": model, "init_device": device_type}


def frozen_of(trainer: dict) -> dict:
    """The "frozen" record of a checkpoint's trainer.json. Checkpoints written before it held their
    frozen base, but a QLoRA run's (adapters only, quantized from a base made on the GPU)."""
    config = trainer.get("config", {})
    qlora = bool(config.get("load_in_4bit"))
    return trainer.get("frozen") or frozen_record(not qlora, config.get("model"), "cuda" if qlora else "cpu")


def resolve_resume(arg: str, output_dir: str) -> Path:
    """`--resume latest` or a path: the checkpoint directory to load, or a BigfitError. `latest` is
    the newest step-N directory, intact or not (`verify` says which): never silently an older one."""
    if arg == "latest":
        root = Path(output_dir) / "checkpoints"
        found = steps(root)
        if not found:
            raise BigfitError(f"--resume: no complete checkpoint in {str(root)!r}; train without --resume "
                              "first, or give a checkpoint directory")
        return found[0]
    p = Path(arg).expanduser()
    if not (p.is_dir() and NAME.match(p.name) and ((p / MARKER).exists() or (p / ".metadata").exists())):
        raise BigfitError(f"--resume {arg!r} is not a complete bigfit checkpoint (a step-N directory holding "
                          f"a {MARKER} marker, made by --save-every)")
    return p

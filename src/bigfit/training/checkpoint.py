"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout: OUTPUT/checkpoints/step-00000100/ holds the DCP files of the model and optimizer (each rank
writes its own shards; a LoRA run's model part is its trainable parameters alone, its frozen base
made again from its source on every start: strategies/base.py `saved_model`), rank-N.pt (that
rank's RNG state), trainer.json (step, config, where the frozen base is: ckptdir.frozen_record),
the model's config.json and tokenizer files (so that `bigfit consolidate` needs nothing else), and
last of all the marker COMPLETE, which holds the manifest: every file's size and CRC-32
(manifest.py), checked by `ckptdir.verify` before anything is loaded or consolidated. Everything
is written under a hidden `.step-N.partial` name first and renamed once every rank has finished,
so a crash mid-save never leaves a directory that looks complete; a leftover `.partial` is ignored
and cleared by the next save of that step.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from ..distributed import Runtime, barrier, gather_objects
from ..errors import BigfitError
from ..faults import maybe_die
from ..strategies import Engine
from . import manifest
from .ckptdir import MARKER, frozen_record, is_checkpoint, steps, trainer_state


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, step: int, engine: Engine, rt: Runtime, trainer_state: dict, write_assets,
         keep: int = 0) -> Path:
    """Collective: every rank calls it. `write_assets(dir)` runs on rank 0 (config, tokenizer).
    `keep` > 0: older complete checkpoints beyond the newest `keep` are deleted once this one is."""
    final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.partial"
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(rt)
    with _one_process_quiet(rt):
        dcp.save(engine.checkpoint_state(), checkpoint_id=str(tmp))  # keyed by parameter names
    torch.save(_rng_state(), tmp / f"rank-{rt.rank}.pt")
    if rt.is_main:
        write_assets(tmp)
        # consolidate --merge reads there whether the frozen base is here or must be made again
        frozen = frozen_record(engine.frozen_in_checkpoints, trainer_state["config"].get("model"), rt.device.type)
        (tmp / "trainer.json").write_text(json.dumps({**trainer_state, "frozen": frozen}, indent=1))
    barrier(rt)
    maybe_die("save", step, rt)
    files = _checksums(tmp, rt)
    if rt.is_main:
        (tmp / MARKER).write_text(manifest.seal({"step": step, "world_size": rt.world_size, "time": time.time(),
                                                 "files": files}))
        _sync_dir(tmp)
        if final.exists():  # this run's own, saved before it resumed from an earlier step: replaced whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _sync_dir(root)
        if keep:
            for old in [p for p in steps(root) if is_checkpoint(p)][keep:]:
                shutil.rmtree(old)
    barrier(rt)
    return final


def _checksums(tmp: Path, rt: Runtime) -> dict | None:
    """Every rank checksums the files it wrote; rank 0 gets the whole manifest (None elsewhere)."""
    names = manifest.file_list(tmp, MARKER)
    parts = gather_objects(manifest.describe(tmp, manifest.written_by(names, rt.rank)), rt)
    return {k: v for part in parts for k, v in part.items()} if rt.is_main else None


class _StatesAcrossOptimizers(DefaultLoadPlanner):
    """Loads an optimizer checkpoint of another strategy: torch's optimizers save their param_groups
    (hyper-parameters, which this run's settings set anyway) beside the states, bigfit's own (zero1,
    the offload engine) the states alone, and pipeline ranks theirs per parameter. Those keys may be
    absent; any other key the job needs and the checkpoint lacks is an error naming it."""

    def create_local_plan(self):
        absent = [k for k in self.state_dict if k not in self.metadata.state_dict_metadata]
        if other := [k for k in absent if not k.startswith("optim.param_groups.")]:
            if f"{other[0]}_codes" in self.metadata.state_dict_metadata:
                raise BigfitError("its optimizer states are 8-bit (--optimizer-states int8), which only bigfit's "
                                  "offload engine reads: resume with --strategy zero2-offload or zero2-offload-nvme "
                                  "(and any --optimizer-states)")
            raise BigfitError(f"it holds no {other[0]!r} ({len(other)} entries this job needs are missing)")
        self.allow_partial_load = True
        return super().create_local_plan()


def load(path: Path, engine: Engine, rt: Runtime) -> dict:
    """Restore model, optimizer and this rank's RNG in place; returns trainer.json. A checkpoint that
    does not fit this job (another model, or a strategy it cannot convert from) is a BigfitError.
    Every engine keys its state by parameter name, so DCP reshards across layouts and strategies."""
    loading = engine.loading(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    try:
        with _one_process_quiet(rt):
            for state, then in [(loading.state, None), *loading.pieces]:
                dcp.load(state, checkpoint_id=str(path), planner=_StatesAcrossOptimizers())
                if then is not None:
                    then()
    except CheckpointException as e:  # a BaseException: it carries every rank's failure
        exc = next(iter(e.failures.values()))[0]
        raise BigfitError(f"checkpoint {str(path)!r} does not fit this {engine.strategy} job: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if loading.note and rt.is_main:
        print(loading.note)
    state = loading.state
    engine.after_load(state)
    trainer = trainer_state(path)
    rng_file = path / f"rank-{rt.rank}.pt"
    if trainer.get("world_size") == rt.world_size and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer


@contextlib.contextmanager
def _one_process_quiet(rt: Runtime):
    """DCP warns that it runs without a process group; for one process that is the intent."""
    with warnings.catch_warnings():
        if not rt.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

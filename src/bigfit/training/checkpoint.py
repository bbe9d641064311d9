"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout: OUTPUT/checkpoints/step-00000100/ holds the DCP files of the model and optimizer (each rank
writes its own shards; a LoRA run's model part is its trainable parameters alone, its frozen base
made again from its source on every start: engine/protocol.py `saved_model`), rank-N.pt (that
rank's RNG state), trainer.json (step, config, where the frozen base is: ckptdir.frozen_record),
the model's config.json and tokenizer files (so that `bigfit consolidate` needs nothing else), and
last of all the marker COMPLETE, which holds the manifest: every file's size and CRC-32
(outputs/manifest.py), checked by `ckptdir.verify` before anything is loaded or consolidated. Everything
is written under a hidden `.step-N.partial` name first and renamed once every rank has finished,
so a crash mid-save never leaves a directory that looks complete; a leftover `.partial` is ignored
and cleared by the next save of that step. A save that a rank cannot write (a full disk) removes its
`.partial` and ends every rank with one line (savefail.py). Loading reads nothing as code: DCP's
metadata, its non-tensor entries and rank-N.pt go through outputs/safeload.py.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ..common.distributed import Runtime, gather_objects
from ..common.faults import maybe_die, maybe_full
from ..common.processes import interrupt_in
from ..engine import Engine
from ..errors import BigfitError
from ..outputs import manifest, safeload
from ..outputs.ckptdir import MARKER, frozen_record, is_checkpoint, steps, trainer_state, verify
from . import savefail


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, step: int, engine: Engine, rt: Runtime, trainer_state: dict, write_assets,
         keep: int = 0) -> Path:
    """Collective: every rank calls it. `write_assets(dir)` runs on rank 0 (config, tokenizer).
    `keep` > 0: older complete checkpoints beyond the newest `keep` are deleted once this one is.
    A rank that cannot write its part (a full disk: savefail.py) ends every rank's save, its
    `.partial` removed, with one line saying the room the checkpoint needs."""
    final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.partial"
    state = engine.checkpoint_state()
    for part in (lambda: _start(tmp, rt), lambda: _write(tmp, step, state, engine, rt, trainer_state, write_assets),
                 lambda: _seal(tmp, final, step, rt)):
        if error := savefail.attempt(part, rt):  # every rank knows: none waits for one that gave up
            savefail.abandon(tmp, final, state, error, rt)
    if rt.is_main and keep:
        for old in [p for p in steps(root) if is_checkpoint(p)][keep:]:
            shutil.rmtree(old)
    return final


def assets_writer(module, tokenizer=None):
    """`save`'s `write_assets`: the model's config (its KV cache on again: off only while training),
    generation config and tokenizer files, so that `bigfit consolidate` needs nothing else."""
    def write(directory: Path) -> None:
        config = copy.deepcopy(module.config)
        config.use_cache = True
        config.save_pretrained(directory)
        if getattr(module, "generation_config", None) is not None:
            module.generation_config.save_pretrained(directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
    return write


def newest(path: Path) -> Path:
    """Checkpoint `path` itself, or the newest complete step-N in it; verified (one line for damage)."""
    found = path if is_checkpoint(path) else next((p for p in steps(path) if is_checkpoint(p)), None)
    if found is None:
        raise BigfitError(f"{str(path)!r} holds no complete checkpoint (a step-N directory with its {MARKER} marker)")
    verify(found, "load {} instead")
    return found


def _start(tmp: Path, rt: Runtime) -> None:
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)


def _write(tmp: Path, step: int, state: dict, engine: Engine, rt: Runtime, trainer_state: dict, write_assets) -> None:
    with _one_process_quiet(rt):
        dcp.save(state, storage_writer=_Writer(tmp, step, rt.rank))  # keyed by parameter names
    buf = io.BytesIO()  # written by Python, whose full disk is an OSError (torch.save to a path: "unexpected pos")
    torch.save(_rng_state(), buf)
    maybe_full("rng", step, rt.rank, tmp / f"rank-{rt.rank}.pt")
    (tmp / f"rank-{rt.rank}.pt").write_bytes(buf.getvalue())
    if rt.is_main:
        write_assets(tmp)
        # consolidate --merge reads there whether the frozen base is here or must be made again
        frozen = frozen_record(engine.frozen_in_checkpoints, trainer_state["config"].get("model"), rt.device.type)
        (tmp / "trainer.json").write_text(json.dumps({**trainer_state, "frozen": frozen}, indent=1))


def _seal(tmp: Path, final: Path, step: int, rt: Runtime) -> None:
    """The manifest into COMPLETE, then the rename: from here on the checkpoint is complete."""
    maybe_die("save", step, rt)
    files = _checksums(tmp, rt)
    if rt.is_main:
        maybe_full("marker", step, rt.rank, tmp / MARKER)
        (tmp / MARKER).write_text(manifest.seal({"step": step, "world_size": rt.world_size, "time": time.time(),
                                                 "files": files}))
        _sync_dir(tmp)
        if final.exists():  # this run's own, saved before it resumed from an earlier step: replaced whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _sync_dir(final.parent)


class _Writer(FileSystemWriter):
    """DCP's writer, with the full-disk fault point of the tests inside its write (faults.maybe_full)."""

    def __init__(self, path: Path, step: int, rank: int):
        super().__init__(str(path))
        self._at = (step, rank, path)

    def write_data(self, plan, planner):
        maybe_full("shards", *self._at)
        return super().write_data(plan, planner)


def _checksums(tmp: Path, rt: Runtime) -> dict | None:
    """Every rank checksums the files it wrote; rank 0 gets the whole manifest (None elsewhere)."""
    names = manifest.file_list(tmp, MARKER)
    try:
        mine = manifest.describe(tmp, manifest.written_by(names, rt.rank))
    except OSError as e:  # rank 0 raises it, after the gather every rank is in
        mine = e
    parts = gather_objects(mine, rt)
    if not rt.is_main:
        return None
    if failed := next((p for p in parts if isinstance(p, OSError)), None):
        raise failed
    return {k: v for part in parts for k, v in part.items()}


class _StatesAcrossOptimizers(safeload.Planner):
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
    saved = safeload.metadata(path)  # DCP's classes only (outputs/safeload.py): a checkpoint is data, never code
    loading = engine.loading(saved.state_dict_metadata)
    try:
        with _one_process_quiet(rt):
            for state, then in [(loading.state, None), *loading.pieces]:
                safeload.load(state, path, _StatesAcrossOptimizers(), saved)
                if then is not None:
                    then()
    except CheckpointException as e:  # a BaseException: it carries every rank's failure
        if (stop := interrupt_in(e)) is not None:  # Ctrl-C while loading: no message about the checkpoint
            raise stop from None
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
        _set_rng_state(safeload.rng_state(rng_file))
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

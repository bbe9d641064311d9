"""Claiming an output directory for one run, before any process trains: `claim`.

One process per job claims (bigfit's launcher before it starts workers, the one process of a
one-process job, or rank 0 under torchrun, which tells the others): it checks the location (and
the NVMe directory), the disk space one checkpoint needs, then takes the directory's lock and
decides what the directory's contents allow:
- empty, or holding only a start that failed before its first step: a new run;
- holding a run: refused, unless --resume (the checkpoint is verified against its manifest and
  its settings compared with this run's, settings/resume.py) or --overwrite (the files bigfit's records say
  that run wrote are removed, nothing else, and nothing an input of this run lies in: overwrite.py);
- a kept file where the run would write (its model directory's config.json, say) is refused too;
and records the run's identity in run.json (runinfo.py). Workers started by the claimer see BIGFIT_OUTPUT_CLAIMED
and check nothing again.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..adapters.lora import adapter_parameters
from ..common.distributed import Runtime, broadcast_object
from ..errors import BigfitError
from ..models.source import build_model, count_parameters
from ..settings import resume
from . import ckptdir, overwrite, rundir, runinfo
from .lock import RunLock

CLAIMED = "BIGFIT_OUTPUT_CLAIMED"  # the output directory a parent process claimed for this job
BYTES_PER_PARAM = 12  # a checkpoint: fp32 weights (or master weights) and Adam's two fp32 moments


def output_path(cfg) -> Path:
    return Path(cfg.output_dir).expanduser().resolve()


@contextlib.contextmanager
def claim(job, rt: Runtime | None = None, speak=print, given: dict[str, str] | None = None):
    """Own `job`'s output directory for the duration (see the module's docstring); yields the lock
    (None where a parent holds it) so that a launcher can hand it to its workers. `rt`: the job's
    ranks (rank 0 claims, the others learn how it went); None: this process alone. `given`: input
    files the settings keep no trace of ({"--config": path}: cli.given_files)."""
    out = output_path(job.cfg)
    if os.environ.get(CLAIMED) == str(out):
        yield None
        return
    lock = _claim_on_rank0(job, out, rt, speak, given or {})
    try:
        with claimed(out):
            yield lock
    finally:
        if lock is not None:
            lock.release()


@contextlib.contextmanager
def claimed(out: Path):
    """Inside, `out` is claimed for this process and the workers it starts (CLAIMED): they check nothing again."""
    before, os.environ[CLAIMED] = os.environ.get(CLAIMED), str(out)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CLAIMED, None)
        else:
            os.environ[CLAIMED] = before


def _claim_on_rank0(job, out: Path, rt: Runtime | None, speak, given: dict[str, str]) -> RunLock | None:
    """Rank 0 (or the one process) claims; every rank then raises what it raised, so that no rank
    waits for rank 0 forever: the user's mistake as one line everywhere, a crash as itself on rank 0
    and as a RuntimeError naming it elsewhere."""
    lock, outcome, crash = None, None, None  # outcome: (the user's mistake?, message)
    if rt is None or rt.is_main:
        try:
            lock = _own(job, out, speak, given)
        except BigfitError as e:
            outcome = (True, str(e))
        except Exception as e:
            crash, outcome = e, (False, f"rank 0 failed while claiming {out}: {type(e).__name__}: {e}")
    if rt is not None:
        outcome = broadcast_object(outcome, rt)
    if crash is not None:
        raise crash
    if outcome is not None:
        raise (BigfitError if outcome[0] else RuntimeError)(outcome[1])
    return lock


def _own(job, out: Path, speak, given: dict[str, str]) -> RunLock:
    cfg = job.cfg
    if cfg.allow_changed and not cfg.resume:
        raise BigfitError("--allow-changed belongs to --resume (settings that may differ from the checkpoint's)")
    rundir.check_location(out, "--output-dir")
    rundir.check_outside(out, "--output-dir")
    if cfg.strategy == "zero2-offload-nvme" and cfg.nvme_dir:
        rundir.check_location(Path(cfg.nvme_dir).expanduser(), "--nvme-dir")
    notes = _check_space(job, out)
    created = not out.exists()
    lock = RunLock(out).acquire()
    try:
        ident = runinfo.identity(job)
        contents = rundir.inspect(out)
        saved = _verified_state(job, out)
        notes += _settle(job, out, contents, ident, saved, given)
        runinfo.write(out, contents.run, ident, job, saved)
    except BaseException:
        lock.release()
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # made by this claim, and nothing was written into it
        raise
    for line in lock.notes + notes:
        speak(line)
    return lock


def _verified_state(job, out: Path) -> dict:
    """The trainer.json of the checkpoint to resume, once its manifest says it is intact ({} for a new run)."""
    ckpt = job.resume_from
    if ckpt is None:
        return {}
    if job.cfg.overwrite and out in ckpt.resolve().parents:
        raise BigfitError(f"--overwrite would remove the run in --output-dir {str(out)!r}, checkpoint {str(ckpt)!r} "
                          "included, that --resume continues: give one of them")
    ckptdir.verify(ckpt, "resume from it with --resume {}")
    return ckptdir.trainer_state(ckpt)


def _settle(job, out: Path, contents: rundir.Contents, ident: dict, saved: dict, given: dict[str, str]) -> list[str]:
    """What the directory's contents allow this run; the lines to say (removals, resume notes)."""
    cfg = job.cfg
    if job.resume_from is not None:
        return _check_resume(job, out, contents, ident, saved, given)
    if contents.holds_run and not cfg.overwrite:
        raise BigfitError(f"--output-dir {str(out)!r} holds {contents.describe()}; continue it with --resume, "
                          "replace it with --overwrite (removes that run's files only), or choose another --output-dir")
    if contents.holds_run:
        return [overwrite.replace(job, out, given)]
    overwrite.check_way(job, contents, new_run=True)
    return []


def _check_resume(job, out: Path, contents: rundir.Contents, ident: dict, saved: dict,
                  given: dict[str, str]) -> list[str]:
    cfg, ckpt = job.cfg, job.resume_from
    inside = out in ckpt.resolve().parents
    ours = saved.get("run_id") is not None and saved.get("run_id") == (contents.run or {}).get("run_id")
    replace = contents.holds_run and not inside and not ours
    if replace and not cfg.overwrite:
        raise BigfitError(f"--output-dir {str(out)!r} holds {contents.describe()}, not the run of checkpoint "
                          f"{str(ckpt)!r}; continue it in a new --output-dir, or replace what is there with "
                          "--overwrite")
    allowed = {k.strip() for k in (cfg.allow_changed or "").split(",") if k.strip()}
    if bad := sorted(allowed - set(resume.MATH)):
        raise BigfitError(f"--allow-changed {','.join(bad)}: not a setting that changes the math (those are "
                          f"{', '.join(resume.MATH)}); other settings may change on resume without it")
    now = {"config": cfg.to_dict(), "plan": job.plan.to_dict(), "world_size": job.job.batching.world_size,
           "identity": ident, "undecided": job.job.undecided}  # sizes a probe picks after this check
    refused, notes = resume.compare(saved, now, allowed)
    if refused:
        raise BigfitError(f"--resume: checkpoint {str(ckpt)!r} was saved with other settings that change the math: "
                          f"{'; '.join(refused)}; give the checkpoint's values, or continue anyway with "
                          f"--allow-changed {','.join(k.split(' ')[0] for k in refused)}")
    if replace:  # only once every check passed: a refused resume removes nothing
        return notes + [overwrite.replace(job, out, given)]
    overwrite.check_way(job, contents, new_run=not (inside or ours))  # its own run's files are its own to write
    return notes


def _check_space(job, out: Path) -> list[str]:
    """Refuse when one checkpoint (and the model directory) cannot fit; warn when all the planned
    ones cannot. Sizes from the (trained) parameter count of a weightless copy of the model."""
    cfg = job.cfg
    if not cfg.checkpoints:
        return []
    skeleton = build_model(job.source, job.model_config, cfg.seed, on_meta=True)
    n = count_parameters(skeleton)
    # a LoRA run's checkpoint: the adapters and their states alone (the frozen base is made again on
    # every start); its adapter directory: megabytes
    trained = adapter_parameters(skeleton, job.lora) if job.lora else n
    ckpt, model = BYTES_PER_PARAM * trained, (4 * n if cfg.consolidate and not cfg.lora else 0)
    free = rundir.free_bytes(out)
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    if free < ckpt + model:
        what = "trained parameter" if job.lora else "parameter"
        raise BigfitError(f"--output-dir {str(out)!r} has {gb(free)} free, but one checkpoint of this model takes "
                          f"{gb(ckpt)} ({BYTES_PER_PARAM} bytes a {what})" + (f" and its model directory {gb(model)}"
                          if model else "") + "; free some space or choose another --output-dir")
    saves = cfg.max_steps // cfg.save_every + 1 if cfg.save_every else 1
    kept = min(saves, cfg.keep_checkpoints + 1) if cfg.keep_checkpoints else saves
    if free < kept * ckpt + model:
        return [f"warning: the {kept} checkpoints this run keeps take {gb(kept * ckpt)}, more than the {gb(free)} free "
                f"in {out}; --keep-checkpoints {max(1, free // ckpt - 1)} would fit"]
    return []

"""A run's identity, recorded in OUTPUT/run.json by the claim (ownership.py) and in every checkpoint's
trainer.json by the loop: a run id (kept by every resumed start), the model's architecture, the data
file's sha256 (the examples' for a dataset directory or a hub name), a LoRA base's weight files'
fingerprint, bigfit's version, and each start's host, pid, process count and settings. run.json also
records the paths the run writes besides its checkpoints and model (rundir.RUN_PATHS): the record
by which `--overwrite` removes its logs."""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..data.digest import file_sha256
from .rundir import RUN_FILE, RUN_PATHS

# Model config keys that say nothing about the architecture (or differ between transformers versions)
VOLATILE = {"_name_or_path", "transformers_version", "use_cache", "architectures", "torch_dtype", "dtype"}


def identity(job) -> dict:
    """What makes a run this run, recorded in run.json and every checkpoint: the model's
    architecture and the data's content, besides the paths given."""
    # through JSON, as trainer.json holds it (id2label's integer keys become strings)
    arch = {k: v for k, v in json.loads(job.model_config.to_json_string(use_diff=False)).items() if k not in VOLATILE}
    data = job.cfg.data
    digest = job.data_sha256 or (file_sha256(Path(data).expanduser()) if data else "embedded")
    ident = {"model": job.cfg.model, "model_config": arch, "data": data, "data_sha256": digest}
    if job.lora:  # the frozen base is read from the model's files again at every start: they must not change
        from ..loading.files import weights_fingerprint

        ident["base_fingerprint"] = weights_fingerprint(job.source)
    return ident


def write(out: Path, old: dict | None, ident: dict, job, saved: dict) -> None:
    """run.json: the run's id (a resumed run keeps its checkpoint's: `saved` is its trainer.json),
    identity and every start."""
    run_id = uuid.uuid4().hex[:12]
    if job.resume_from is not None:
        run_id = saved.get("run_id") or (old or {}).get("run_id") or run_id  # checkpoints of earlier versions have none
    run = old if old and old.get("run_id") == run_id else {}
    start = {"time": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
             "world_size": job.job.batching.world_size, "resumed_from": str(job.resume_from or "") or None,
             "config": job.cfg.to_dict()}
    body = {"run_id": run_id, "bigfit_version": _version(), "identity": ident, "paths": list(RUN_PATHS),
            "starts": run.get("starts", []) + [start]}
    tmp = out / (RUN_FILE + ".tmp")
    tmp.unlink(missing_ok=True)  # a link left there: writing through it would write into what it points to
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, out / RUN_FILE)


def read(out: Path) -> dict:
    """run.json of the run in `out` (the claim wrote it)."""
    return json.loads((Path(out) / RUN_FILE).read_text())


def _version() -> str:
    try:
        return version("bigfit")
    except PackageNotFoundError:
        return "unknown"

"""`bigfit bench`'s own settings (its flags; the rest are `bigfit train`'s, for every row). Light: the
command line reads it to build its flags without loading torch."""
from __future__ import annotations

import dataclasses

from ..checks import validate
from ..config import TrainConfig
from ..errors import BigfitError
from ..settings import load_config_file


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    strategies: str = "auto"  # auto: those the planner predicts to fit here; all: every one that runs here; or a comma-separated list of them
    precisions: str | None = None  # comma-separated (fp32, bf16, fp16); None: bf16 on a GPU that has it, else fp32
    train_samples: int = 512  # samples each method trains on after its warm-up, at its largest micro-batch
    untimed_steps: int = 2  # steps each method runs before the timed ones (kernels, allocator, compilation)
    row_timeout_s: float = 900.0  # seconds one row (probe, training, evaluation) may take before it is stopped
    output_dir: str = "bench-out"  # bench.md, bench.csv, bench.json, bench.png and each row's run
    overwrite: bool = False  # replace a bench directory bigfit wrote there before


# what `bigfit bench` decides for each of its rows itself, or names otherwise (BenchSettings)
BENCH_OWN = ("extra", "resume", "consolidate", "checkpoints", "eval_on_start", "probe_only", "strategy", "precision",
             "batch_size", "micro_batch_size", "max_steps", "eval_every", "save_every", "keep_checkpoints",
             "allow_changed", "report_to", "max_train_samples", "output_dir", "overwrite")


def from_args(ns) -> tuple[BenchSettings, TrainConfig]:
    """(BenchSettings, the TrainConfig every row starts from): bench's flags, then defaults <- --config
    file <- the training flags given."""
    own = {f.name for f in dataclasses.fields(BenchSettings)}
    given = {k: v for k, v in vars(ns).items() if k not in ("command", "config")}
    bench = BenchSettings(**{k: v for k, v in given.items() if k in own})
    for name in ("train_samples", "row_timeout_s"):
        if getattr(bench, name) <= 0:
            raise BigfitError(f"--{name.replace('_', '-')} must be positive, got {getattr(bench, name)}")
    if bench.untimed_steps < 0:
        raise BigfitError(f"--untimed-steps must be 0 or more, got {bench.untimed_steps}")
    values = load_config_file(ns.config) if getattr(ns, "config", None) else {}
    values.update({k: v for k, v in given.items() if k not in own})
    if bad := sorted(set(values) & set(BENCH_OWN)):
        raise BigfitError(f"bigfit bench decides {', '.join(bad)} for each row itself; leave them out of --config")
    base = TrainConfig(**values)
    validate(base)
    return bench, base

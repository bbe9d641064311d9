"""`bigfit bench`'s own settings (its flags; the rest are `bigfit train`'s, for every row, but those
config.BENCH_DECIDES names). Light: bench.py declares them in the one schema every parser is built
from, without loading torch. Field comments are the `--help` texts."""
from __future__ import annotations

import dataclasses

from ..errors import BigfitError
from .config import BENCH_DECIDES

BENCH_OWN = BENCH_DECIDES  # the TrainConfig fields bench decides for each of its rows itself


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    strategies: str = "auto"  # auto: those the planner predicts to fit here; all: every one that runs here; or a comma-separated list of them
    precisions: str | None = None  # comma-separated (fp32, bf16, fp16); None: bf16 on a GPU that has it, else fp32
    train_samples: int = 512  # samples each method trains on after its warm-up, at its largest micro-batch
    untimed_steps: int = 2  # steps each method runs before the timed ones (kernels, allocator, compilation)
    row_timeout_s: float = 900.0  # seconds one row (probe, training, evaluation) may take before it is stopped
    output_dir: str = "bench-out"  # the bench's directory: bench.md, bench.csv, bench.json, bench.png and each row's run
    overwrite: bool = False  # replace a bench directory bigfit wrote there before

    def __post_init__(self):
        for name in ("train_samples", "row_timeout_s"):
            if getattr(self, name) <= 0:
                raise BigfitError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.untimed_steps < 0:
            raise BigfitError(f"--untimed-steps must be 0 or more, got {self.untimed_steps}")

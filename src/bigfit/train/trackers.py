"""Dashboards: `--report-to tensorboard,wandb,mlflow` (the Trainer's names and convention; `none`, the
default, leaves metrics.jsonl alone). Rank 0 sends each step's numbers, the ones metrics.jsonl holds
(loss, learning rate, gradient norm, tokens/s, peak GPU memory, the evaluation's figures at the steps
that have one), and the run's settings once:
- tensorboard: event files under OUTPUT/runs (torch.utils.tensorboard);
- wandb: a run in OUTPUT/wandb, offline unless WANDB_MODE says otherwise or an API key is set
  (WANDB_PROJECT names the project, default "bigfit"); `wandb sync` uploads an offline one later;
- mlflow: a run in the experiment MLFLOW_EXPERIMENT_NAME (default "bigfit") of MLFLOW_TRACKING_URI,
  or of a local file store at OUTPUT/mlruns (`mlflow ui --backend-store-uri OUTPUT/mlruns`).
Each is an optional package, the `bigfit[tracking]` extra; a missing one is one line before any work
(checks.reporters).
"""
from __future__ import annotations

import os
from pathlib import Path

class Trackers:
    """The reporters of one run, on rank 0: `log` each record, `close` at the end."""

    def __init__(self, names: tuple[str, ...], out_dir: Path, settings: dict, run_name: str):
        self.writers = [_OPEN[n](out_dir, settings, run_name) for n in names]

    def log(self, record: dict) -> None:
        scalars = {k: float(v) for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for w in self.writers:
            w.log(record["step"], scalars)

    def close(self) -> None:
        for w in self.writers:
            w.close()


class _TensorBoard:
    def __init__(self, out_dir: Path, settings: dict, run_name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=str(out_dir / "runs" / run_name))
        self.w.add_text("settings", "\n".join(f"    {k}: {v}" for k, v in settings.items()))

    def log(self, step: int, scalars: dict) -> None:
        for k, v in scalars.items():  # written out by the writer's own thread (and at close), not per step
            self.w.add_scalar(_group(k), v, step)

    def close(self) -> None:
        self.w.close()


class _WandB:
    def __init__(self, out_dir: Path, settings: dict, run_name: str):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "bigfit"), name=run_name, dir=str(out_dir),
                              config=settings, mode=mode, reinit="finish_previous")

    def log(self, step: int, scalars: dict) -> None:
        self.run.log({_group(k): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, out_dir: Path, settings: dict, run_name: str):
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # a local file store: no server, no database package
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it, "in maintenance mode"
            mlflow.set_tracking_uri((out_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "bigfit"))
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:500] for k, v in settings.items()})

    def log(self, step: int, scalars: dict) -> None:
        self.mlflow.log_metrics({_group(k): v for k, v in scalars.items()}, step=step, run_id=self.run.info.run_id)

    def close(self) -> None:
        self.mlflow.end_run()


_OPEN = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


def _group(key: str) -> str:
    """The Trainer's layout: train/loss, eval/loss."""
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"

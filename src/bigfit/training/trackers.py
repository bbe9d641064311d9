"""Dashboards: `--report-to tensorboard,wandb,mlflow` (the Trainer's names and convention; `none`, the
default, leaves metrics.jsonl alone). Rank 0 sends each step's numbers, the ones metrics.jsonl holds
(loss, learning rate, gradient norm, tokens/s, peak GPU memory, the evaluation's figures at the steps
that have one), the planner's predicted peak for the run's layout beside the measured one
(train/predicted_peak_gpu_gb: job/autoplan.py's row for the strategy and degrees the run uses),
and the run's settings once:
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
    """The reporters of one run, on rank 0: `log` each record, `close` at the end. `predicted_gb`:
    the planner's peak for the run's layout, drawn beside each step's measured peak."""

    def __init__(self, names: tuple[str, ...], out_dir: Path, settings: dict, run_name: str,
                 predicted_gb: float | None = None):
        self.writers = [_OPEN[n](out_dir, settings, run_name) for n in names]
        self.predicted = {} if predicted_gb is None else {"predicted_peak_gpu_gb": predicted_gb}

    def log(self, record: dict) -> None:
        if "loss" in record:  # a step's record
            record = {**record, **self.predicted}
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


def predicted_peak(cfg, world: int, lengths: tuple[int, int] | None = None) -> tuple[float | None, str]:
    """(the planner's peak GB for this run, or None; a note saying so when it could not be rated). A
    dashboard's extra: whatever the planner raises is a note, never the run's end."""
    from ..job.autoplan import predicted_peak_gb

    try:
        gb = predicted_peak_gb(cfg, world, lengths)
    except Exception as e:  # noqa: BLE001  the run goes on without the line
        return None, f"the planner's peak memory is not on the dashboards ({type(e).__name__}: {e})"
    return gb, "" if gb is not None else "the planner rates no row for this layout: no predicted peak on the dashboards"

"""Experiment trackers beside ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

``logging.trackers`` names them (null: TensorBoard where it is installed). Each tracker
gets, on rank 0 only, the resolved config when the run starts (``start``), every logged
row's numbers with their step (``log``), and the final metrics when the run ends
(``finish``), which also closes it; a run that fails or is interrupted by a second Ctrl-C
closes its trackers with the status ``failed`` / ``killed``. W&B runs offline by default
(files under ``<run_dir>/wandb``; ``wandb sync`` uploads them later) and MLflow writes to a
file store under ``<run_dir>/mlruns`` unless ``logging.mlflow_uri`` names another.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from longboat.core.config.trackers import TRACKERS, tracker_names

FINISHED, STOPPED, FAILED, KILLED = "finished", "stopped", "failed", "killed"
"""How a run ended, as ``Tracker.finish`` is told: trained to the end, stopped by a signal
at a step boundary (resumable), failed with an error, interrupted mid-step."""


class Tracker(Protocol):
    """One experiment tracker of a run (module doc)."""

    name: str

    def start(self, config: Mapping[str, Any]) -> None:
        """The run starts with the resolved config ``config`` (nested mappings)."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """The numbers of one metrics row at ``step``."""

    def finish(self, final: Mapping[str, float], status: str) -> None:
        """The run ended (``status``: FINISHED, STOPPED, FAILED, KILLED) with the final metrics
        ``final`` (empty on failure); flush and close."""

    def where(self) -> str:
        """One line saying where to look at the run."""


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


class TensorBoardTracker:
    """TensorBoard events under ``<run_dir>/tensorboard`` (a resumed run purges the events
    past its start step); the config as a text summary."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, start_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = run_dir / "tensorboard"
        purge = None if start_step is None else start_step + 1
        self._writer: Any = SummaryWriter(log_dir=str(self.dir), purge_step=purge)
        self._step = start_step or 0

    def start(self, config: Mapping[str, Any]) -> None:
        text = json.dumps(dict(config), indent=2, default=str)
        self._writer.add_text("config", f"```\n{text}\n```", global_step=self._step)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)

    def finish(self, final: Mapping[str, float], status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def where(self) -> str:
        return f"TensorBoard: tensorboard --logdir {self.dir}"


class WandbTracker:
    """A Weights & Biases run: offline (``<run_dir>/wandb/offline-run-*``, uploaded later by
    ``wandb sync``) or online, in project ``logging.project``; the final metrics go into the
    run's summary."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, project: str, mode: str) -> None:
        self.run_dir, self.run_name, self.project, self.mode = run_dir, run_name, project, mode
        self._run: Any = None

    def start(self, config: Mapping[str, Any]) -> None:
        import wandb

        settings = wandb.Settings(
            console="off", silent=True, x_disable_stats=True, x_save_requirements=False
        )
        self._run = wandb.init(
            project=self.project,
            name=self.run_name,
            dir=str(self.run_dir),
            mode=self.mode,
            config=dict(config),
            settings=settings,
            reinit="create_new",
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._run is not None:
            self._run.log(dict(scalars), step=step)

    def finish(self, final: Mapping[str, float], status: str) -> None:
        if self._run is None:
            return
        self._run.summary.update({f"final/{k}": v for k, v in final.items()})
        self._run.summary["final/status"] = status
        self._run.finish(exit_code={FAILED: 1, KILLED: 255}.get(status, 0))
        self._run = None

    def where(self) -> str:
        if self.mode == "offline":
            return f"W&B:         offline run under {self.run_dir / 'wandb'} (wandb sync <folder>)"
        return f"W&B:         project {self.project}, run {self.run_name}"


class MLflowTracker:
    """An MLflow run in experiment ``logging.project``: the config as parameters (dotted
    keys) and as the artifact ``config.json``, every row's numbers as metrics with their
    step, the final metrics as ``final/<name>`` at the last step, and the run's end status."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, project: str, uri: str | None) -> None:
        self.uri = uri or (run_dir / "mlruns").resolve().as_uri()
        if self.uri.startswith("file:"):
            # MLflow 3 keeps its file store behind this switch (a database store needs the
            # full mlflow package; the file store works with mlflow-skinny).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.run_name, self.project = run_name, project
        self._client: Any = None
        self.run_id: str | None = None
        self._last_step = 0

    def start(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self._client = client = MlflowClient(tracking_uri=self.uri)
        experiment = client.get_experiment_by_name(self.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(self.project)
        )
        self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        params = [
            Param(key, str(value)[:MAX_PARAM_VAL_LENGTH]) for key, value in _flatten(config).items()
        ]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])
        client.log_dict(self.run_id, dict(config), "config.json")

    def _log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars.items()]
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        if self.run_id is not None:
            self._log(step, scalars)
            self._last_step = step

    def finish(self, final: Mapping[str, float], status: str) -> None:
        if self.run_id is None:
            return
        self._log(self._last_step, {f"final/{k}": v for k, v in final.items()})
        end = {FAILED: "FAILED", KILLED: "KILLED"}.get(status, "FINISHED")
        self._client.set_terminated(self.run_id, end)
        self.run_id = None

    def where(self) -> str:
        return f"MLflow:      {self.uri} (experiment {self.project})"


def make_trackers(logging: Any, run_dir: Path, *, start_step: int | None = None) -> list[Tracker]:
    """The trackers ``logging`` (a ``LoggingConfig``) asks for, writing under ``run_dir``."""
    made: list[Tracker] = []
    for name in tracker_names(logging.trackers):
        if name == "tensorboard":
            made.append(TensorBoardTracker(run_dir, start_step))
        elif name == "wandb":
            made.append(
                WandbTracker(run_dir, logging.run_name, logging.project, logging.wandb_mode)
            )
        elif name == "mlflow":
            made.append(
                MLflowTracker(run_dir, logging.run_name, logging.project, logging.mlflow_uri)
            )
    return made


__all__ = [
    "FAILED",
    "FINISHED",
    "KILLED",
    "STOPPED",
    "TRACKERS",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "make_trackers",
]

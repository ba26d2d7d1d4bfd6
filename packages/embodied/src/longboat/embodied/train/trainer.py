"""``longboat-embodied train``: the embodied run (``training.build_training``) on core's trainer.

Core's ``longboat.core.train.Trainer`` owns the loop: resume (``checkpoint.resume``), the LR
schedule, the NaN guard, SIGTERM / SIGUSR1 / Ctrl-C saves, the progress bar, metrics,
checkpoints, the profiler window, ``config.yaml`` and ``loss_curve.png`` in
``<logging.dir>/<run_name>/``, and the final export of a run that was not interrupted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from longboat.core.train import RunResult, run_training
from longboat.embodied.train.training import build_training


def train(cfg: Any, *, on_step: Callable[[int], None] | None = None) -> RunResult:
    """Run one embodied experiment from a composed, validated config
    (``EmbodiedExperimentConfig``). ``on_step(step)`` is called after every completed step
    (1-based; tests stop a run with it)."""
    return run_training(cfg, build_training, on_step=on_step)


__all__ = ["train"]

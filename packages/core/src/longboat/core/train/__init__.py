"""The training skeleton every stack runs on.

A stack implements ``Training`` (what ``build_training(cfg)`` returns: model, optimizer,
data and one step) and its ``train`` command is ``run_training(cfg, build_training)``;
``Trainer`` owns the loop: resume, signals, progress, metrics, NaN guard, LR schedule,
checkpoint cadence, eval, profiling, export and the loss curve.

Names are imported on first use, so ``longboat.core.train.training`` (the interface a
stack subclasses) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "LaggedUpdateGate": "gate",
    "UpdateGate": "gate",
    "RunSchedule": "schedule",
    "DeviceLRTable": "schedule",
    "STOP_SIGNALS": "trainer",
    "Callback": "trainer",
    "RunResult": "trainer",
    "StepWindow": "trainer",
    "Trainer": "trainer",
    "run_training": "trainer",
    "typed_config": "trainer",
    "StepOutput": "training",
    "Training": "training",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)

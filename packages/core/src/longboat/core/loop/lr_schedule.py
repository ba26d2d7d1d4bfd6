"""Learning-rate schedules: constant, linear, cosine and WSD, each after a linear warmup.

The multiplier ``f(s)`` of the peak LR at scheduler step ``s`` (``s`` = number of
``scheduler.step()`` calls so far, so the first optimizer step uses ``f(0)``):

- warmup, ``s < W``: ``f = (s + 1) / W`` (reaches the peak on the last warmup step);
- after warmup, with progress ``p = clamp((s - W) / D, 0, 1)`` over ``D`` decay steps
  (``optim.schedule.decay_steps``, default ``total_steps - W``) and floor ``m = min_lr_ratio``:

  - constant: ``1``
  - linear: ``1 - (1 - m) p``
  - cosine: ``m + (1 - m) (1 + cos(pi p)) / 2``
  - wsd (warmup-stable-decay): ``1`` for the first ``D - K`` steps, then linear to ``m``
    over the last ``K = max(1, round(wsd_decay_fraction * D))`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from longboat.core.config.errors import ProblemCollector
from longboat.core.config.schema import LR_SCHEDULES, LRScheduleConfig

SCHEDULES = LR_SCHEDULES
"""Valid ``optim.schedule.name`` values."""

_KEY = "optim.schedule"


@dataclass
class ScheduleFn:
    """Picklable LR multiplier (LambdaLR stores its fields in ``state_dict``)."""

    name: str
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float
    wsd_decay_steps: int

    def __call__(self, step: int) -> float:
        w = self.warmup_steps
        if step < w:
            return (step + 1) / w
        since = step - w
        m = self.min_lr_ratio
        if self.name == "constant":
            return 1.0
        if self.name == "wsd":
            stable = self.decay_steps - self.wsd_decay_steps
            if since < stable:
                return 1.0
            q = min(1.0, (since - stable) / self.wsd_decay_steps)
            return 1.0 - (1.0 - m) * q
        p = min(1.0, since / self.decay_steps)
        if self.name == "linear":
            return 1.0 - (1.0 - m) * p
        return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))


def make_schedule_fn(cfg: LRScheduleConfig, total_steps: int) -> ScheduleFn:
    """Validate ``cfg`` against ``total_steps`` and build the multiplier function."""
    problems = ProblemCollector()
    if cfg.name not in SCHEDULES:
        problems.add(
            f"{_KEY}.name",
            "unknown LR schedule",
            value=cfg.name,
            fix=f"use one of {', '.join(SCHEDULES)}",
        )
    if not isinstance(total_steps, int) or total_steps < 1:
        problems.add("train.steps", "must be >= 1", value=total_steps)
    if cfg.warmup_steps < 0:
        problems.add(f"{_KEY}.warmup_steps", "must be >= 0", value=cfg.warmup_steps)
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        problems.add(f"{_KEY}.min_lr_ratio", "must be in [0, 1]", value=cfg.min_lr_ratio)
    if cfg.decay_steps is not None and cfg.decay_steps < 1:
        problems.add(
            f"{_KEY}.decay_steps",
            "must be >= 1 or null",
            value=cfg.decay_steps,
            fix="use null to decay over train.steps - warmup_steps",
        )
    if not 0.0 < cfg.wsd_decay_fraction <= 1.0:
        problems.add(
            f"{_KEY}.wsd_decay_fraction", "must be in (0, 1]", value=cfg.wsd_decay_fraction
        )
    problems.raise_if_any()
    decay = (
        cfg.decay_steps if cfg.decay_steps is not None else max(1, total_steps - cfg.warmup_steps)
    )
    return ScheduleFn(
        name=cfg.name,
        warmup_steps=cfg.warmup_steps,
        decay_steps=decay,
        min_lr_ratio=cfg.min_lr_ratio,
        wsd_decay_steps=max(1, min(decay, round(cfg.wsd_decay_fraction * decay))),
    )


def build_lr_scheduler(optimizer: Optimizer, cfg: LRScheduleConfig, total_steps: int) -> LambdaLR:
    """A LambdaLR applying ``cfg`` to every param group's LR; call ``.step()`` after each optimizer step.

    Raises ``ConfigError`` naming the ``optim.schedule.*`` key for invalid settings.
    """
    return LambdaLR(optimizer, make_schedule_fn(cfg, total_steps))

"""The NaN guard and the LR schedule as one training step sees them: an update gate.

A stack's step calls ``gate.allow(step, loss, grad_norm)`` between its backward and its
optimizer update, and updates only when it returns True. The trainer calls
``gate.end_step()`` after the step and ``gate.flush()`` before anything that reads the
guard's counters or the host LR schedule (a log line, an eval, a checkpoint, the end).

- ``UpdateGate`` (synchronous): ``allow`` reads the loss (and grad norm) on the host, one
  device sync per step while the guard is on, and ``end_step`` steps the LR schedule when
  the update was taken (a skipped step does not advance the schedule).
- ``LaggedUpdateGate``: for steps that skip a non-finite update on the device themselves.
  ``allow`` stages the values without waiting and resolves every older step (so the host
  waits for the previous step at most); each resolved verdict steps the schedule unless it
  was a skip. Stacks subclass it with how their step skips on the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from longboat.core.loop.nan_guard import DeferredNaNGuard, NaNGuard, Verdict


class UpdateGate:
    """The synchronous gate (module doc)."""

    lagged = False
    """True when verdicts come one step late (``LaggedUpdateGate``)."""

    def __init__(self, guard: NaNGuard, schedule: Any, *, why_sync: str | None = None) -> None:
        self.guard = guard
        self.schedule = schedule
        self.why_sync = why_sync
        """Why this run reads the loss every step (None: no reason given)."""
        self.last: Verdict | None = None
        """The latest resolved verdict."""
        self._pending: bool | None = None

    def allow(self, step: int, loss: Any, grad_norm: Any = None) -> bool:
        """True = apply this step's update (reads ``loss`` on the host when the guard is on)."""
        stepped = self.guard.check(loss, grad_norm)
        self._pending = stepped
        self.last = Verdict(step, math.nan, None, stepped)  # the values: the trainer reads them
        return stepped

    def end_step(self) -> None:
        """After the step: advance the LR schedule when its update was taken."""
        if self._pending:
            self.schedule.step()
        self._pending = None

    def flush(self) -> list[Verdict]:
        """Resolve pending verdicts (none: every verdict is known when ``allow`` returns)."""
        return []

    def describe(self) -> str:
        """One line for the start of a run."""
        if not self.guard.cfg.enabled:
            return "NaN guard: off (train.nan_guard.enabled=false)."
        why = f" ({self.why_sync})" if self.why_sync else ""
        return f"NaN guard: reads the loss every step{why}."

    def close(self) -> None:
        """Undo whatever the gate installed on the optimizer (nothing here)."""


class LaggedUpdateGate(UpdateGate):
    """The gate of a step that skips non-finite updates on the device (module doc).

    Between two ``flush()`` calls the host schedule lags by the unresolved step; the
    counters, the abort (``NonFiniteLossError``, raised while resolving step n, at most one
    step later than the synchronous guard) and every update's LR are the synchronous
    guard's. The staged values must be the same on every rank (a global loss).
    """

    lagged = True

    def __init__(self, guard: NaNGuard, schedule: Any, accelerator: Any = None) -> None:
        super().__init__(guard, schedule)
        self.deferred = DeferredNaNGuard(guard, accelerator)

    @property
    def pending(self) -> list[int]:
        """Steps whose verdict is not resolved yet."""
        return self.deferred.pending

    def allow(self, step: int, loss: Any, grad_norm: Any = None) -> bool:
        """Stage step ``step`` and resolve every older one; True (the device decides)."""
        self.stage(step, loss, grad_norm)
        return True

    def stage(self, step: int, loss: torch.Tensor, grad_norm: Any = None) -> list[Verdict]:
        """Stage ``step``'s values without waiting; resolve (and return) the older verdicts."""
        if grad_norm is None:
            grad_norm = torch.zeros((), dtype=torch.float64, device=loss.device)
        self.deferred.submit(step, loss, grad_norm)
        return self._apply(self.deferred.resolve(keep=1))

    def end_step(self) -> None:
        """Nothing: resolved verdicts step the schedule."""

    def flush(self) -> list[Verdict]:
        """Resolve every pending verdict (waits for the newest staged step)."""
        return self._apply(self.deferred.resolve())

    def describe(self) -> str:
        return "NaN guard: skips on the device, checked one step late (no per-step host sync)."

    def _apply(self, verdicts: list[Verdict]) -> list[Verdict]:
        for verdict in verdicts:
            if verdict.stepped:
                self.schedule.step()  # a skipped step does not advance the schedule
            self.last = verdict
        return verdicts


__all__ = ["LaggedUpdateGate", "UpdateGate"]

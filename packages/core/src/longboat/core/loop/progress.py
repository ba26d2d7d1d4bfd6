"""Rich progress bar for training: step, loss, tokens/s (or samples/s) and ETA."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

UNITS = ("tokens", "samples")
"""What ``items`` in ``update()`` counts."""


def _si(value: float) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f}{suffix}"
    return f"{value:.1f}"


def _hms(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class TrainProgress:
    """Progress of a training run, used as a context manager on rank 0.

    Rates and ETA come from a sliding window of the last ``window`` updates, so
    they track the current speed rather than the average since start (which
    includes compilation and warmup). On a non-interactive console (log file,
    Slurm) a plain line is printed at most every ``plain_interval_s`` seconds
    instead of a live bar. ``enabled=False`` makes every call a no-op.
    """

    def __init__(
        self,
        total_steps: int,
        unit: str = "tokens",
        enabled: bool = True,
        initial_step: int = 0,
        *,
        console: Console | None = None,
        window: int = 20,
        plain_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if unit not in UNITS:
            raise ValueError(f"TrainProgress: unit={unit!r} is not one of {UNITS}")
        self.total_steps = total_steps
        self.unit = unit
        self.enabled = enabled
        self.step = initial_step
        self.loss: float | None = None
        self._console = console
        self._clock = clock
        self._history: deque[tuple[float, int, float]] = deque(maxlen=max(2, window + 1))
        self._items = 0.0
        self._plain_interval_s = plain_interval_s
        self._last_plain: float | None = None
        self._progress: Progress | None = None
        self._task: Any = None

    # --- numbers ----------------------------------------------------------------------------
    @property
    def rate(self) -> float | None:
        """Items per second over the window (None before two points exist)."""
        if len(self._history) < 2:
            return None
        (t0, _, n0), (t1, _, n1) = self._history[0], self._history[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    @property
    def eta_seconds(self) -> float | None:
        """Seconds until ``total_steps`` at the window's step time (None when unknown)."""
        if len(self._history) < 2:
            return None
        (t0, s0, _), (t1, s1, _) = self._history[0], self._history[-1]
        if s1 <= s0:
            return None
        return (self.total_steps - s1) * (t1 - t0) / (s1 - s0)

    def summary(self) -> str:
        """One line: ``step 5/10 | loss 2.3456 | 2.00k tokens/s | eta 0:00:05``."""
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        rate = "-" if self.rate is None else _si(self.rate)
        eta = "-:--:--" if self.eta_seconds is None else _hms(self.eta_seconds)
        return (
            f"step {self.step}/{self.total_steps} | loss {loss} | {rate} {self.unit}/s | eta {eta}"
        )

    # --- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> TrainProgress:
        self._history.clear()
        self._history.append((self._clock(), self.step, 0.0))
        if not self.enabled:
            return self
        console = self._console or Console()
        self._console = console
        if console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                console=console,
                transient=False,
            )
            self._task = self._progress.add_task(
                "train", total=self.total_steps, completed=self.step, stats=self._stats()
            )
            self._progress.start()
        return self

    def update(self, step: int, loss: float | Any | None = None, items: float = 0.0) -> None:
        """Record that ``step`` finished, with its ``loss`` and the ``items`` it processed."""
        now = self._clock()
        self.step = int(step)
        if loss is not None:
            self.loss = float(loss.item() if hasattr(loss, "item") else loss)
        self._items += float(items)
        self._history.append((now, self.step, self._items))
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=self.step, stats=self._stats())
        elif self._last_plain is None or now - self._last_plain >= self._plain_interval_s:
            self._last_plain = now
            self._console.print(self.summary(), highlight=False)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        elif self.enabled and self._console is not None and len(self._history) > 1:
            self._console.print(self.summary(), highlight=False)

    def _stats(self) -> str:
        # the bar already shows M/N steps: drop the "step" field from the summary
        return self.summary().split(" | ", 1)[1]

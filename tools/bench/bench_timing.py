"""Step times of a training loop that runs steps back to back, as a real loop does.

A loop that synchronises the device after every step serialises the host and the device:
whatever the host does between steps (the next batch, host-to-device copies, RNG seeding,
the launches before the first kernel) leaves the device idle, although a training loop
that reads its loss only at log points hides that work behind the device's previous step.
``StepClock`` times steps without that per-step sync: it records a device event after
each step is enqueued, and a step's time is the gap between consecutive events on the
device's timeline. Where the host falls behind (a step that reads a value on the host, as
an HF-Trainer-style loop's per-step ``loss.item()`` does, or a slow input pipeline) the
device idles and the gap shows it; where the host keeps ahead, the gap is the device time.

``sync_every_step=True`` gives the previous method (synchronise before and after every
step, host wall time per step) for comparisons with older result files.
"""

from __future__ import annotations

import time
from typing import Any


class StepClock:
    """Marks step boundaries on the device's stream; ``step_times()`` reads them afterwards.

    ``start()`` before the first timed step (one device sync), ``mark()`` after each timed
    step is enqueued (no sync), ``stop()`` after the last one (one device sync; returns the
    window's wall time in seconds).
    """

    def __init__(self, acc: Any, *, sync_every_step: bool = False) -> None:
        self.acc = acc
        self.sync_every_step = sync_every_step
        self._events: list[Any] = []
        self._host: list[float] = []
        self._t0: float | None = None
        self._wall: float | None = None

    @property
    def method(self) -> str:
        if self.sync_every_step:
            return "device synchronize before and after every step (host wall time)"
        return "steps back to back, device events between steps (no per-step sync)"

    def start(self) -> None:
        self.acc.synchronize()
        self._t0 = time.perf_counter()
        self._host = [self._t0]
        self._events = [self._record()]

    def before_step(self) -> None:
        """Call right before a timed step (a device sync in ``sync_every_step`` mode)."""
        if self.sync_every_step:
            self.acc.synchronize()
            self._host.append(time.perf_counter())

    def mark(self) -> None:
        """Call right after a timed step was enqueued."""
        if self._t0 is None:
            raise RuntimeError("StepClock.mark() before start()")
        if self.sync_every_step:
            self.acc.synchronize()
            self._host.append(time.perf_counter())
        else:
            self._events.append(self._record())

    def stop(self) -> float:
        if self._t0 is None:
            raise RuntimeError("StepClock.stop() before start()")
        self.acc.synchronize()
        self._wall = time.perf_counter() - self._t0
        return self._wall

    def step_times(self) -> list[float]:
        """Seconds per timed step (call after ``stop()``)."""
        if self._wall is None:
            raise RuntimeError("StepClock.step_times() before stop()")
        if self.sync_every_step:
            # host stamps: start, then (before, after) per step
            stamps = self._host[1:]
            return [b - a for a, b in zip(stamps[0::2], stamps[1::2])]
        return [a.elapsed_time(b) / 1000.0 for a, b in zip(self._events, self._events[1:])]

    def _record(self) -> Any:
        event = self.acc.event(enable_timing=True)
        event.record()
        return event

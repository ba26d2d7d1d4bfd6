"""Step times of a training loop that runs steps back to back, as a real loop does.

Syncing the device after every step serialises host and device: whatever the host does between
steps (the next batch, copies, launches) leaves the device idle, although a loop that reads its
loss only at log lines hides that work behind the previous step. ``StepClock`` records a device
event after each step is enqueued; a step's time is the gap between consecutive events on the
device's timeline. Where the host falls behind (a value read every step, as an HF-Trainer-style
``loss.item()``, or a slow input pipeline) the gap shows the idle device; where it keeps ahead,
the gap is the device time. Longboat runs are timed by ``StepTimer`` (a ``Trainer`` callback), a
baseline's own loop by ``time_loop``; both report the same numbers (``summary``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from longboat.core.train import Callback

METHOD = "steps back to back, device events between steps (no per-step sync)"


class StepClock:
    """``start()`` before the first timed step (one device sync), ``mark()`` after each timed
    step is enqueued (no sync), ``stop()`` after the last (one sync; returns the window's wall
    seconds); ``step_times()`` reads the event gaps afterwards."""

    def __init__(self, acc: Any) -> None:
        self.acc = acc
        self._events: list[Any] = []
        self._t0: float | None = None
        self._wall: float | None = None

    def start(self) -> None:
        self.acc.synchronize()
        self._t0 = time.perf_counter()
        self._events = [self._record()]

    def mark(self) -> None:
        if self._t0 is None:
            raise RuntimeError("StepClock.mark() before start()")
        self._events.append(self._record())

    def stop(self) -> float:
        if self._t0 is None:
            raise RuntimeError("StepClock.stop() before start()")
        self.acc.synchronize()
        self._wall = time.perf_counter() - self._t0
        return self._wall

    def step_times(self) -> list[float]:
        """Seconds per timed step (after ``stop()``)."""
        if self._wall is None:
            raise RuntimeError("StepClock.step_times() before stop()")
        return [a.elapsed_time(b) / 1000.0 for a, b in zip(self._events, self._events[1:])]

    def _record(self) -> Any:
        event = self.acc.event(enable_timing=True)
        event.record()
        return event


class Timing:
    """A timed window: device step times, wall clock, per-step host batch wait and iteration."""

    def __init__(self, acc: Any) -> None:
        self.clock = StepClock(acc)
        self.step_times: list[float] = []
        self.window_s = 0.0
        self.data_wait: list[float] = []
        self.host: list[float] = []

    def summary(self, items_per_step: float) -> dict[str, Any]:
        med = statistics.median(self.step_times)
        return {
            "median_step_s": med,
            "items_per_s": items_per_step / med,
            "window_items_per_s": items_per_step * len(self.step_times) / self.window_s,
            "step_times_s": self.step_times,
            "window_s": self.window_s,
            "data_wait_s": statistics.median(self.data_wait) if self.data_wait else None,
            "host_step_s": statistics.median(self.host) if self.host else None,
            "timed_steps": len(self.step_times),
            "timing": METHOD,
        }


class StepTimer(Callback):
    """Times steps ``warmup + 1 .. warmup + steps`` of a ``Trainer.fit`` (``warmup >= 1``:
    the clock starts when warm-up step ``warmup`` is queued)."""

    exact = False

    def __init__(self, acc: Any, warmup: int, steps: int) -> None:
        if warmup < 1:
            raise ValueError("StepTimer needs warmup >= 1 (the clock starts after a step)")
        self.warmup, self.steps = warmup, steps
        self.timing = Timing(acc)
        self.data_wait: list[float] = []
        """Filled by ``timed_batches``: the host's wait for each step's batch."""
        self._last = 0.0

    def on_step_end(self, trainer: Any, step: int, out: Any) -> None:
        t, now = self.timing, time.perf_counter()
        if self.warmup < step <= self.warmup + self.steps:
            t.clock.mark()
            t.host.append(now - self._last)
            t.data_wait.append(self.data_wait[step - 1])
            if step == self.warmup + self.steps:
                t.window_s = t.clock.stop()
                t.step_times = t.clock.step_times()
        elif step == self.warmup:
            t.clock.start()
        self._last = time.perf_counter()

    def timed_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` with the wait for each recorded in ``data_wait``."""
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.data_wait.append(time.perf_counter() - t0)
            yield batch


def time_loop(
    acc: Any, batches: Iterator[Any], step: Callable[[Any, int], Any], warmup: int, steps: int
) -> tuple[Timing, list[float]]:
    """A baseline's own loop: ``step(next(batches), i)`` for ``warmup + steps`` steps, the last
    ``steps`` timed; returns the timing and every step's loss (read after the window)."""
    timing, losses = Timing(acc), []
    for i in range(warmup + steps):
        if i == warmup:
            timing.clock.start()
        t0 = time.perf_counter()
        batch = next(batches)
        t1 = time.perf_counter()
        losses.append(step(batch, i))
        if i >= warmup:
            timing.clock.mark()
            timing.data_wait.append(t1 - t0)
            timing.host.append(time.perf_counter() - t0)
    timing.window_s = timing.clock.stop()
    timing.step_times = timing.clock.step_times()
    return timing, [float(x) for x in losses]

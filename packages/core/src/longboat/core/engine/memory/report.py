"""The plan's second line: the measured peak beside the prediction, after the first steps."""

from __future__ import annotations

from typing import Any

from longboat.core.engine.device_skip import GRAPH_WARMUP
from longboat.core.engine.memory.budget import GB
from longboat.core.engine.memory.plan import MemoryPlan
from longboat.core.train.trainer import Callback

REPORT_AFTER_STEPS = GRAPH_WARMUP + 2
"""Steps before the measured peak is printed: past the eager warm-up and the CUDA-graph
capture, so the peak includes the captured step's memory."""


def measured_peak_line(accelerator: Any, plan: MemoryPlan, steps: int) -> str:
    """The measured-peak line: the accelerator's peak allocated memory since the run started
    (its stats are host counters: no device sync) against the plan's prediction."""
    peak = accelerator.memory_stats()["peak_allocated_gb"]
    predicted = plan.estimate.total / GB
    off = (peak - predicted) / predicted if predicted else 0.0
    return (
        f"Memory plan: measured peak {peak:.1f} GB after {steps} steps (predicted "
        f"{predicted:.1f} GB, {off:+.0%})."
    )


class MeasuredPeak(Callback):
    """A trainer callback that prints ``measured_peak_line`` once, ``after_steps`` steps into
    the run (on the main rank; nothing where the device reports no memory of its own)."""

    def __init__(
        self, accelerator: Any, plan: MemoryPlan, *, after_steps: int = REPORT_AFTER_STEPS
    ) -> None:
        self.accelerator = accelerator
        self.plan = plan
        self.after_steps = after_steps
        self.seen = 0
        self.line: str | None = None
        """The printed line (None until then)."""
        self.done = accelerator.memory_capacity() is None

    def on_step_end(self, trainer: Any, step: int, out: Any) -> None:
        """Count the step; print the line at the ``after_steps``-th."""
        self.seen += 1
        if self.done or self.seen < self.after_steps:
            return
        self.done = True
        self.line = measured_peak_line(self.accelerator, self.plan, self.seen)
        trainer.console.print(self.line)

"""A torch.profiler window over a step range, exported as a Chrome/Perfetto trace."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from longboat.core.config.schema import ProfilerConfig
from longboat.core.device import get_accelerator

_DEVICE_ACTIVITY = {"cuda": "CUDA", "xpu": "XPU"}


class StepProfiler:
    """Profiles steps ``start_step..end_step`` (inclusive) when ``cfg.enabled``.

    Call ``.step(step)`` at the *start* of every training step. The trace is
    written to ``<out_dir>/trace_steps<start>-<end>_rank<r>.json`` when the
    window ends (or at ``__exit__`` if training stops inside it); ``trace_path``
    holds the file once written. A run resumed inside the window profiles
    the remaining steps of it.
    """

    def __init__(self, cfg: ProfilerConfig, out_dir: str | Path) -> None:
        if cfg.enabled and not 0 <= cfg.start_step <= cfg.end_step:
            raise ValueError(
                f"train.profiler: start_step={cfg.start_step}, end_step={cfg.end_step} is not a "
                "window. Fix: set 0 <= train.profiler.start_step <= train.profiler.end_step."
            )
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.trace_path: Path | None = None
        self._prof: profile | None = None
        self._marker: record_function | None = None
        self._done = False

    @property
    def active(self) -> bool:
        """True while steps are being recorded."""
        return self._prof is not None

    def _activities(self) -> list[ProfilerActivity]:
        activities = [ProfilerActivity.CPU]
        name = _DEVICE_ACTIVITY.get(get_accelerator().device_type)
        if name is not None and hasattr(ProfilerActivity, name):
            activities.append(getattr(ProfilerActivity, name))
        return activities

    def step(self, step: int) -> None:
        """Mark the start of ``step``: opens, advances or closes the window."""
        if not self.cfg.enabled or self._done:
            return
        if self._prof is None:
            if self.cfg.start_step <= step <= self.cfg.end_step:
                self._prof = profile(
                    activities=self._activities(), record_shapes=self.cfg.record_shapes
                )
                self._prof.start()
                self._mark(step)
            return
        if step > self.cfg.end_step:
            self._finish()
        else:
            self._mark(step)

    def _mark(self, step: int) -> None:
        # Our own step ranges, labelled with the training step (torch's own markers need a
        # schedule and count from 0).
        self._end_marker()
        self._marker = record_function(f"ProfilerStep#{step}")
        self._marker.__enter__()

    def _end_marker(self) -> None:
        if self._marker is not None:
            self._marker.__exit__(None, None, None)
            self._marker = None

    def _finish(self) -> None:
        assert self._prof is not None
        self._end_marker()
        self._prof.stop()
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / (
            f"trace_steps{self.cfg.start_step}-{self.cfg.end_step}_rank{rank}.json"
        )
        self._prof.export_chrome_trace(str(path))
        self.trace_path = path
        self._prof = None
        self._done = True

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prof is not None:
            self._finish()

"""Metrics sink: JSON lines always, and the run's experiment trackers (TensorBoard, W&B,
MLflow: ``longboat.core.loop.trackers``)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from longboat.core.loop.trackers import FAILED, FINISHED, KILLED, Tracker


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().item() if value.numel() == 1 else value.detach().tolist()
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        # Strict JSON has no NaN/inf: keep them readable as strings.
        return str(value)
    return value


def _scalar(value: Any) -> float | None:
    """The value as a float for the trackers (NaN/inf kept), or None if not a scalar number."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.detach().item()
    elif hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without the rows of steps after ``step``."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = []
    for line in lines:
        try:
            row_step = int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError, TypeError):
            continue  # a line cut short by a crash
        if row_step <= step:
            kept.append(line)
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)


class MetricsSink:
    """Writes ``<log_dir>/<run_name>/metrics.jsonl`` and feeds the run's trackers.

    Each JSONL line is ``{"step": int, "time": unix_seconds, <metric>: value, ...}``;
    tensors become numbers, NaN/inf become the strings ``"nan"``/``"inf"``. The file is
    appended to, so a resumed run continues it; with ``start_step`` (the step a run starts
    from) the rows of later steps, left by a run that died after its last checkpoint, are
    dropped first (and TensorBoard purges its events past that step), so every step appears
    once. Each row is appended with the file opened only for that write, so a run that
    fails without closing its sink leaves no open file behind. ``trackers`` (built with
    ``make_trackers`` for this run folder) get each row's numbers; ``start`` hands them the
    config and ``close`` the final metrics. With ``enabled=False`` (non-zero ranks) every
    call is a no-op.
    """

    def __init__(
        self,
        log_dir: str | Path,
        run_name: str = "run",
        trackers: Sequence[Tracker] = (),
        enabled: bool = True,
        *,
        start_step: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(log_dir) / run_name
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._open = False
        self.trackers: list[Tracker] = []
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if start_step is not None:
            _drop_rows_after(self.jsonl_path, start_step)
        self.jsonl_path.touch()
        self._open = True
        self.trackers = list(trackers)

    def start(self, config: Mapping[str, Any]) -> None:
        """Hand every tracker the run's resolved config."""
        for tracker in self.trackers:
            tracker.start(config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` at ``step`` (the numbers also go to the trackers)."""
        if not self._open:
            return
        row = {"step": int(step), "time": time.time()}
        row.update({k: _to_jsonable(v) for k, v in metrics.items()})
        with self.jsonl_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.trackers:
            scalars = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
            for tracker in self.trackers:
                tracker.log(int(step), scalars)

    def close(self, final: Mapping[str, Any] | None = None, *, status: str = FINISHED) -> None:
        """Close the trackers with the run's final metrics ``final`` and how it ended
        (``trackers.FINISHED`` / ``STOPPED`` / ``FAILED`` / ``KILLED``); safe to call twice.
        Every tracker is closed even when one fails."""
        self._open = False
        trackers, self.trackers = self.trackers, []
        numbers = {k: s for k, v in (final or {}).items() if (s := _scalar(v)) is not None}
        error: BaseException | None = None
        for tracker in trackers:
            try:
                tracker.finish(numbers, status)
            except Exception as exc:  # close the others, then report the first failure
                error = error or exc
        if error is not None and status not in (FAILED, KILLED):
            raise error

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.close(status=KILLED if issubclass(exc_type, KeyboardInterrupt) else FAILED)

"""Metrics sink: JSON lines always, TensorBoard events when tensorboard is installed."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch


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
    """The value as a float for TensorBoard (NaN/inf kept), or None if not a scalar number."""
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
    """Writes ``<log_dir>/<run_name>/metrics.jsonl`` and TensorBoard events next to it.

    Each JSONL line is ``{"step": int, "time": unix_seconds, <metric>: value, ...}``;
    tensors become numbers, NaN/inf become the strings ``"nan"``/``"inf"``. The file is
    appended to, so a resumed run continues it; with ``start_step`` (the step a run starts
    from) the rows of later steps, left by a run that died after its last checkpoint, are
    dropped first (and TensorBoard purges its events past that step), so every step appears
    once. Each row is appended with the file opened only for that write, so a run that
    fails without closing its sink leaves no open file behind. With ``enabled=False``
    (non-zero ranks) every call is a no-op.
    """

    def __init__(
        self,
        log_dir: str | Path,
        run_name: str = "run",
        tensorboard: bool = True,
        enabled: bool = True,
        *,
        start_step: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(log_dir) / run_name
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.tb_dir = self.run_dir / "tensorboard"
        self._open = False
        self._tb: Any = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if start_step is not None:
            _drop_rows_after(self.jsonl_path, start_step)
        self.jsonl_path.touch()
        self._open = True
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional extra longboat-core[tensorboard]
                SummaryWriter = None
            if SummaryWriter is not None:
                purge = None if start_step is None else start_step + 1
                self._tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=purge)

    @property
    def tensorboard_enabled(self) -> bool:
        """True when TensorBoard events are being written."""
        return self._tb is not None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` at ``step`` (numbers also go to TensorBoard as scalars)."""
        if not self._open:
            return
        row = {"step": int(step), "time": time.time()}
        row.update({k: _to_jsonable(v) for k, v in metrics.items()})
        with self.jsonl_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key in metrics:
                scalar = _scalar(metrics[key])
                if scalar is not None:
                    self._tb.add_scalar(key, scalar, global_step=int(step))

    def close(self) -> None:
        """Flush and close the files (safe to call twice)."""
        self._open = False
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

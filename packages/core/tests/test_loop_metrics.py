"""MetricsSink: JSONL lines parse to what was logged; TensorBoard events appear."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from longboat.core.loop.metrics import MetricsSink


def test_jsonl_lines_parse(tmp_path):
    with MetricsSink(tmp_path, run_name="exp", trackers=()) as sink:
        sink.log(1, {"loss": torch.tensor(2.5), "lr": 1e-3, "note": "warm"})
        sink.log(2, {"loss": float("nan"), "grad_norm": torch.tensor([float("inf")])})
        assert sink.trackers == []
    lines = (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == 2.5 and rows[0]["lr"] == 1e-3 and rows[0]["note"] == "warm"
    assert rows[1]["loss"] == "nan" and rows[1]["grad_norm"] == "inf"
    assert all(isinstance(r["time"], float) for r in rows)


def test_appends_on_resume(tmp_path):
    for step in (1, 2):
        with MetricsSink(tmp_path, trackers=()) as sink:
            sink.log(step, {"loss": float(step)})
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [1.0, 2.0]


def test_disabled_writes_nothing(tmp_path):
    sink = MetricsSink(tmp_path, enabled=False)
    sink.log(1, {"loss": 1.0})
    sink.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_events_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from longboat.core.loop.trackers import TensorBoardTracker

    sink = MetricsSink(
        tmp_path, run_name="tb", trackers=[TensorBoardTracker(tmp_path / "tb", None)]
    )
    for step in range(3):
        sink.log(step, {"loss": torch.tensor(1.0 / (step + 1)), "tag": "x"})
    sink.close()
    events = list((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["loss"]  # the string metric is JSONL-only
    values = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert values == [(0, 1.0), (1, pytest.approx(0.5)), (2, pytest.approx(1 / 3))]


def test_a_sink_left_open_by_a_failed_run_leaks_no_file(tmp_path: Path) -> None:
    """A run that dies between rows never closes its sink: no ResourceWarning, rows kept."""
    import gc
    import warnings

    sink = MetricsSink(tmp_path, run_name="failed")
    sink.log(1, {"loss": 2.5})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del sink
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    rows = (tmp_path / "failed" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["loss"] == 2.5

"""StepProfiler writes one Chrome trace covering exactly the configured steps."""

from __future__ import annotations

import json

import pytest
import torch

from longboat.core.config.schema import ProfilerConfig
from longboat.core.loop.profiler import StepProfiler


def _train(prof: StepProfiler, steps: int) -> None:
    x = torch.randn(32, 32)
    for step in range(steps):
        prof.step(step)
        y = x @ x
        x = y / y.norm()


def _step_labels(path) -> set[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}


def test_trace_covers_window(tmp_path):
    with StepProfiler(ProfilerConfig(enabled=True, start_step=2, end_step=3), tmp_path) as prof:
        _train(prof, 6)
        assert not prof.active
    assert prof.trace_path == tmp_path / "trace_steps2-3_rank0.json"
    assert list(tmp_path.iterdir()) == [prof.trace_path]
    assert _step_labels(prof.trace_path) == {"ProfilerStep#2", "ProfilerStep#3"}
    names = {e.get("name") for e in json.loads(prof.trace_path.read_text())["traceEvents"]}
    assert "aten::mm" in names


def test_window_cut_short_by_end_of_training(tmp_path):
    with StepProfiler(ProfilerConfig(enabled=True, start_step=3, end_step=10), tmp_path) as prof:
        _train(prof, 5)  # steps 3 and 4 fall inside the window
        assert prof.active
    assert not prof.active
    assert _step_labels(prof.trace_path) == {"ProfilerStep#3", "ProfilerStep#4"}


def test_disabled_writes_nothing(tmp_path):
    with StepProfiler(ProfilerConfig(enabled=False), tmp_path / "p") as prof:
        _train(prof, 10)
    assert prof.trace_path is None and not (tmp_path / "p").exists()


def test_bad_window():
    with pytest.raises(ValueError, match=r"train\.profiler"):
        StepProfiler(ProfilerConfig(enabled=True, start_step=5, end_step=2), "x")

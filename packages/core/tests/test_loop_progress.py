"""TrainProgress renders loss, throughput and ETA (deterministic clock)."""

from __future__ import annotations

from io import StringIO

import pytest
from rich.console import Console

from longboat.core.loop.progress import TrainProgress


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _console() -> tuple[Console, StringIO]:
    buf = StringIO()
    return Console(file=buf, force_terminal=False, width=120), buf


def test_rate_and_eta_from_window():
    clock = FakeClock()
    console, buf = _console()
    with TrainProgress(10, unit="tokens", console=console, clock=clock, plain_interval_s=0) as p:
        for step in range(1, 5):
            clock.t += 0.5
            p.update(step, loss=3.0 - 0.25 * step, items=1000)
        assert p.rate == pytest.approx(2000.0)  # 1000 tokens per 0.5 s
        assert p.eta_seconds == pytest.approx(3.0)  # 6 steps left * 0.5 s
        assert p.summary() == "step 4/10 | loss 2.0000 | 2.00k tokens/s | eta 0:00:03"
    out = buf.getvalue()
    assert "loss 2.0000" in out and "2.00k tokens/s" in out and "eta 0:00:03" in out
    assert "step 1/10 | loss 2.7500" in out  # first update printed too


def test_plain_output_is_rate_limited_and_final_line_printed():
    clock = FakeClock()
    console, buf = _console()
    with TrainProgress(
        100, unit="samples", console=console, clock=clock, plain_interval_s=10, initial_step=50
    ) as p:
        for step in range(51, 61):
            clock.t += 2.0
            p.update(step, loss=1.0, items=8)
    lines = buf.getvalue().strip().splitlines()
    # steps 51..60 end at t=102..120: printed at t=102 (first) and t=112 (10 s later), then
    # the summary on exit
    assert [ln.split(" | ")[0] for ln in lines] == ["step 51/100", "step 56/100", "step 60/100"]
    assert lines[-1] == "step 60/100 | loss 1.0000 | 4.0 samples/s | eta 0:01:20"


def test_terminal_bar_renders_stats():
    clock = FakeClock()
    buf = StringIO()
    console = Console(file=buf, force_terminal=True, width=160, color_system=None)
    with TrainProgress(4, console=console, clock=clock) as p:
        for step in range(1, 5):
            clock.t += 1.0
            p.update(step, loss=0.5, items=300)
    out = buf.getvalue()
    assert "4/4" in out and "loss 0.5000" in out and "300.0 tokens/s" in out
    assert "eta 0:00:00" in out


def test_disabled_prints_nothing():
    console, buf = _console()
    with TrainProgress(3, console=console, enabled=False) as p:
        p.update(1, loss=1.0, items=1)
    assert buf.getvalue() == ""
    with pytest.raises(ValueError, match="unit"):
        TrainProgress(3, unit="frames")

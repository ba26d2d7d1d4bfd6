"""tools/bench/memory_plan.py at tiny shapes on CPU: without a budget the run plans nothing,
with one the plan chooses and the run trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

DATA = ["--embodiments", "2", "--episodes", "2", "--episode-length", "12", "16"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def test_planned_and_measured_rows(tmp_path: Path) -> None:
    import memory_plan

    out = tmp_path / "results.json"
    rc = memory_plan.main(["--out", str(out), "--tiny", "--models", "pi05", "--budgets",
                           "auto,0.012", "--batch", "4", "--steps", "1", "--warmup", "1",
                           "--workers", "0", *DATA, "--data-dir", str(tmp_path / "ds"),
                           "--results-dir", str(tmp_path / "res")])  # fmt: skip
    result = json.loads(out.read_text())
    assert rc == 0, result
    auto, tight = result["runs"]
    assert auto["plan_line"].startswith("Memory plan: none (the cpu device")
    assert "choice" not in auto and auto["off"] is None
    assert tight["choice"]["recompute"] in ("selective", "full")
    assert tight["predicted_gb"] <= tight["budget_gb"] == pytest.approx(0.012)
    weighed = [o["predicted_gb"] for o in tight["options"]]
    fits = [w <= tight["budget_gb"] for w in weighed]
    assert not fits[0] and weighed[fits.index(True)] == tight["predicted_gb"]
    assert tight["off"] is None  # the CPU's peak is its resident memory: not compared
    md = (tmp_path / "res" / f"memory_plan_{result['date']}_tiny.md").read_text()
    assert "pi05 @ 0.012" in md and "recompute=" in md

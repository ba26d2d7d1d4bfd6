"""CPU smoke test of ``tools/bench/vla_throughput.py``: the reference GR00T-N1.6 loop and the
longboat loop each train 2 steps at tiny shapes on the same synthetic LeRobot dataset."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "tools" / "bench" / "vla_throughput.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("vla_throughput_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not BENCH.is_file(), reason="tools/ is not part of an installed wheel")
def test_both_loops_train_two_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench = _load_bench()
    out = tmp_path / "results.json"
    rc = bench.main(
        [
            "--out", str(out), "--tiny", "--batch", "2", "--steps", "2", "--warmup", "0",
            "--workers", "0", "--embodiments", "2", "--episodes", "2",
            "--episode-length", "12", "16", "--data-dir", str(tmp_path / "ds"),
            "--results-dir", str(tmp_path / "res"), "--runs", "reference,longboat",
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert rc == 0, result
    runs = {r["name"]: r for r in result["runs"]}
    assert set(runs) == {"reference", "longboat"}
    for run in runs.values():
        assert run["timed_steps"] == 2
        assert len(run["losses"]) == 2
        assert all(math.isfinite(x) and x > 0 for x in run["losses"]), run["losses"]
        assert run["samples_per_s"] > 0
    # Same model on both sides: trainable counts equal, frozen within 0.5% (the reference's
    # Siglip2 position table must be square: 4x4 vs longboat's 4x6 at tiny shapes, 448
    # parameters; Qwen3 keeps its final norm). At full shapes the gap is 2048 of 1.34B.
    ref, lb = runs["reference"]["params"], runs["longboat"]["params"]
    assert ref["trainable"] == lb["trainable"]
    assert abs(ref["frozen"] - lb["frozen"]) <= 0.005 * lb["frozen"]
    # Flow-matching losses of random-init models on min-max normalised targets: ~1-3.
    for run in runs.values():
        assert 0.2 < run["losses"][0] < 10.0
    assert (tmp_path / "res" / f"vla_throughput_{result['date']}_tiny.md").is_file()

"""tools/bench/dsa_kernels.py at its tiny shape under Triton's interpreter (a fresh process:
the interpreter is chosen before triton is imported): every row runs, both implementations'
output and gradients match the dense reference, and the table and JSON say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_testkit import run_script


def test_tiny_rows_time_and_check_both_implementations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "dsa.json"
    stdout = run_script("dsa_kernels.py", ["--tiny", "--out", str(out)], timeout=600)
    result = json.loads(out.read_text())
    rows = result["runs"]
    assert [(r["name"], r["impl"]) for r in rows] == [
        ("indexer_topk", "new"),
        ("attention fwd", "new"),
        ("attention fwd+bwd", "new"),
        ("check (last queries)", "new"),
        ("attention fwd", "before"),
        ("attention fwd+bwd", "before"),
        ("check (last queries)", "before"),
    ]
    assert not [r for r in rows if "error" in r], rows
    for r in rows:
        if r["kind"] == "check":  # bf16 inputs against the fp32 dense reference
            assert r["passed"] and max(r["err_out"], r["err_dq"], r["err_dk"]) <= 2e-2, r
            assert min(r["err_out"], r["err_dq"], r["err_dk"]) > 0.0, r  # a real comparison
        else:
            assert r["ms"] > 0 and r["runs"] == 1 and r["tflops"] > 0, r
    heads = {r["impl"]: r["head_block"] for r in rows if r["kind"] == "fwd"}
    assert heads == {"new": 16, "before": 16}  # the interpreter's one tile; the old kernel's
    assert "'heads': 18" in result["config"]["dims"] and result["gpu"] == "cpu"
    assert "attention fwd+bwd: new" in stdout and "tuned:" in stdout


def test_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import dsa_kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert dsa_kernels.main(["--tiny"]) == 2

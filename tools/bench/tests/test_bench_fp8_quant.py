"""The FP8 quantisation benchmark: its shapes, bytes and winner table on CPU, the ``--tiny``
smoke run under Triton's interpreter (every config byte for byte against the reference), and
the timed run on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import fp8_quant
import pytest
import torch
from bench_testkit import run_script

from longboat.kernels.fp8.quantize_triton import DUAL_CONFIG, TILE_CONFIGS


def test_qwen3_shapes_are_the_layer_gemm_operands() -> None:
    shapes = fp8_quant.shapes_of("qwen3_1_7b")
    acts = {
        (8192, 2048): ["dy fc2", "dy proj", "x fc1", "x proj", "x qkv"],
        (8192, 4096): ["dy qkv"],
        (8192, 6144): ["x fc2"],
        (8192, 12288): ["dy fc1"],
    }
    weights = {(2048, 2048): ["W proj"], (2048, 6144): ["W fc2"], (4096, 2048): ["W qkv"],
               (12288, 2048): ["W fc1"]}  # fmt: skip
    for entry in ("dual", "groups"):
        assert {k: sorted(v) for k, v in shapes[entry].items()} == acts
    for entry in ("blocks", "blocks_t"):
        assert shapes[entry] == weights


def test_moved_bytes() -> None:
    # bf16 in, two FP8 outputs, a scale per 128 values along each dimension
    assert fp8_quant.moved_bytes("dual", 8192, 2048) == 8192 * 2048 * 4 + 4 * (
        8192 * 16 + 2048 * 64
    )
    assert fp8_quant.moved_bytes("groups", 8192, 2048) == 8192 * 2048 * 3 + 4 * 8192 * 16
    assert fp8_quant.moved_bytes("blocks_t", 2048, 6144) == 2048 * 6144 * 3 + 4 * 16 * 48


def test_winner_is_the_fastest_exact_config() -> None:
    base = {"entry": "dual", "shape": [256, 128], "operands": ["x"], "bytes": 1000}
    rows = [
        {**base, "impl": "a", "default": True, "exact": True, "ms": 2.0},
        {**base, "impl": "b", "default": False, "exact": True, "ms": 1.0},
        {**base, "impl": "c", "default": False, "exact": False, "ms": 0.5},  # wrong codes
        {**base, "impl": "old", "default": False, "exact": False, "ms": 4.0},
        {**base, "impl": "d", "default": False, "error": "OutOfResources: shared memory"},
    ]
    for r in rows:
        if "ms" in r:
            r["gb_s"] = 1000 / (r["ms"] * 1e-3) / 1e9
            r["peak_frac"] = 1000 / (r["ms"] * 1e-3) / fp8_quant.HBM_BYTES_PER_S
    (win,) = fp8_quant.winners(rows)
    assert (win["best"], win["ms"], win["default_ms"], win["old_ms"]) == ("b", 1.0, 2.0, 4.0)
    assert win["speedup_vs_old"] == 4.0
    totals = fp8_quant.layer_totals(rows)
    # c (not exact) and d (failed) have no total; old's counts though its codes may differ
    assert [(t["impl"], t["layer_ms"], t["speedup_vs_old"]) for t in totals] == [
        ("b", 1.0, 4.0),
        ("a", 2.0, 2.0),
        ("old", 4.0, 1.0),
    ]
    assert totals[0]["gb_s"] == 1000 / 1e-3 / 1e9
    table = fp8_quant.render(rows, [win], totals)
    assert "| dual | 256 x 128 | x | a * | 2000.0 |" in table
    assert "| NO |" in table and "failed: OutOfResources" in table
    assert "| dual | 256 x 128 | b | 1000.0 |" in table
    assert "| dual | a * | 2000.0 | 0 | 2.00x |" in table


def test_time_ms_is_a_median_of_event_times() -> None:
    calls = []
    ms = fp8_quant.time_ms(calls.append, torch.zeros(4), iters=5, warmup=2, flush=torch.zeros(8))
    assert len(calls) == 7 and ms >= 0.0


def test_tiny_run_every_config_exact_in_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "q.json"
    stdout = run_script("fp8_quant.py", ["--tiny", "--out", str(out)])
    rows = json.loads(out.read_text())["runs"]
    names = [c.name for c in TILE_CONFIGS] + ["old"]
    want = [("dual", s, n) for s in ([200, 257], [136, 120]) for n in names]
    want += [("groups", s, "library") for s in ([200, 257], [136, 120])]
    want += [(e, [136, 200], n) for e in ("blocks", "blocks_t") for n in names]
    assert [(r["entry"], r["shape"], r["impl"]) for r in rows] == want
    assert all(r["exact"] is True and r["ms"] is None for r in rows), rows
    assert [r["impl"] for r in rows if r["default"] and r["entry"] == "dual"] == [
        DUAL_CONFIG.name
    ] * 2
    assert f"DUAL_CONFIG={DUAL_CONFIG.name}" in stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_run_times_the_default_and_old_dual_kernels(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    args = ["--entries", "dual,blocks_t", "--configs", f"{DUAL_CONFIG.name},old", "--iters", "5"]
    assert fp8_quant.main([*args, "--out", str(out), "--results-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert all(r["exact"] and r["gb_s"] > 0 for r in result["runs"])
    assert {(w["entry"], w["best"] in (DUAL_CONFIG.name, "old")) for w in result["winners"]} == {
        ("dual", True),
        ("blocks_t", True),
    }

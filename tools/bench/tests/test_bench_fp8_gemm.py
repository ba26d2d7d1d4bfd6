"""The FP8 GEMM benchmark's harness on CPU (``--smoke``: tiny shapes, emulated GEMMs)."""

from __future__ import annotations

import json
from pathlib import Path

import fp8_gemm


def test_smoke_rows_numerics_and_layer_totals(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    assert fp8_gemm.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["runs"]
    options = ["bf16", "blockwise", "rowwise", "tensorwise"]
    assert [(r["linear"], r["option"]) for r in rows] == [
        (lin, opt) for lin in ("qkv", "proj", "fc1", "fc2") for opt in options
    ]
    assert rows[0]["shape"] == [128, 256, 128]  # (heads + 2 kv) x head_dim outputs
    for r in rows:
        # bf16's own rounding ~2^-9 relative; FP8 ~4% (e4m3), ~6% for e5m2 gradients
        bound = 5e-3 if r["option"] == "bf16" else (0.08 if r["option"] == "tensorwise" else 0.05)
        assert max(r["err_y"], r["err_dx"], r["err_dw"]) <= bound, r
        assert r["fwd_bwd_ms"] > 0 and r["adaptive_choice"] in options
    totals = {t["option"]: t for t in result["layer_totals"]}
    assert set(totals) == {*options, "adaptive"} and totals["bf16"]["speedup"] == 1.0
    assert totals["bf16"]["layer_ms"] == sum(r["fwd_bwd_ms"] for r in rows if r["option"] == "bf16")


def test_glu_smoke_rows(tmp_path: Path) -> None:
    """``--glu``: per shape the rows of the SwiGLU -> FP8 operands (unfused, fused at two warp
    counts) and of the down projection's fwd+bwd (unfused, fused), equal results; on CPU the
    fused path falls back to the pair."""
    out = tmp_path / "glu.json"
    assert fp8_gemm.main(["--smoke", "--glu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["runs"]
    assert [(r["what"].split()[0], r["path"]) for r in rows] == [
        ("swiglu", "unfused"), ("swiglu", "fused"), ("swiglu", "fused, 8 warps"),
        ("fc2", "unfused"), ("fc2", "fused"),
    ]  # fmt: skip
    assert rows[0]["shape"] == [128, 384, 128]
    for r in rows:
        assert r["equal_operands"] and r["equal_outputs_and_grads"], r
        assert r["ms"] > 0 and r["fused_kernel_ran"] is False
    # 10 bytes per activation value unfused (h read, a written and read, two FP8 codes), 6 fused
    scales = 4 * (128 * 192 // 128) * 2
    assert (
        rows[0]["bytes"] == 128 * 192 * 10 + scales and rows[1]["bytes"] == 128 * 192 * 6 + scales
    )

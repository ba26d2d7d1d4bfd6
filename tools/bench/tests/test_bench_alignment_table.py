"""tools/bench/alignment_table.py: the newest GPU result of each model, judged as the
alignment scripts judge it, one PNG per measured row."""

from __future__ import annotations

import json
from pathlib import Path

import alignment_table as at
import bench_align


def _result(path: Path, benchmark: str, date: str, gpu: str, config: dict, shift: float) -> None:
    ref = [5.0 - 0.01 * i for i in range(40)]
    pert = [y + (0.01 if i % 2 else -0.01) for i, y in enumerate(ref)]
    lb = [y + shift * (-1) ** i for i, y in enumerate(ref)]  # no lean
    runs = [{"name": "reference", "losses": ref}, {"name": "reference_perturbed", "losses": pert},
            {"name": "longboat", "losses": lb}]  # fmt: skip
    relative = benchmark != "llm_loss_alignment"
    result = {"benchmark": benchmark, "date": date, "gpu": gpu, "commit": "abc1234",
              "versions": {}, "config": config, "runs": runs,
              "verdict": bench_align.judge(lb, ref, pert, relative=relative)}  # fmt: skip
    path.write_text(json.dumps(result))


def test_rows_are_the_newest_gpu_runs_and_unmeasured_models_say_so(tmp_path: Path) -> None:
    _result(tmp_path / "llm_loss_alignment_2026-11-01.json", "llm_loss_alignment",
            "2026-11-01", "H100", {}, 0.5)  # fmt: skip
    _result(tmp_path / "llm_loss_alignment_2026-12-01.json", "llm_loss_alignment",
            "2026-12-01", "H100", {}, 0.005)  # fmt: skip
    _result(tmp_path / "llm_loss_alignment_qwen3_1_7b_2026-12-01.json", "llm_loss_alignment",
            "2026-12-01", "H200", {"family": "qwen3"}, 0.05)  # fmt: skip
    _result(tmp_path / "llm_loss_alignment_2026-12-05_tiny.json", "llm_loss_alignment",
            "2026-12-05", "cpu", {}, 0.0)  # fmt: skip
    _result(tmp_path / "vla_loss_alignment_2026-12-02.json", "vla_loss_alignment",
            "2026-12-02", "H100", {"model": "groot_n1_6"}, 0.0)  # fmt: skip
    # a --variants run (its longboat row) is newer than the plain run of the same day
    _result(tmp_path / "llm_loss_alignment_moonlight_4l_2026-12-07.json", "llm_loss_alignment",
            "2026-12-07", "H100", {"family": "deepseek_v3"}, 0.05)  # fmt: skip
    _result(tmp_path / "llm_loss_alignment_moonlight_4l_2026-12-07_variants.json",
            "llm_loss_alignment", "2026-12-07", "H100", {"family": "deepseek_v3"}, 0.005)  # fmt: skip
    found = at.newest(tmp_path)
    assert sorted(found) == ["llm_886m", "llm_moonlight_4l", "llm_qwen3_1_7b", "vla_groot_n1_6"]
    assert found["llm_moonlight_4l"][0].stem.endswith("_variants")
    assert found["llm_886m"][0].name == "llm_loss_alignment_2026-12-01.json"  # not the CPU one
    md = at.write(tmp_path, "2026-12-07").read_text()
    rows = {line.split(" | ")[0][2:]: line for line in md.splitlines() if line.startswith("| ")}
    # |diff| 0.005 against a band of 0.01 (x1.5): inside; 0.05 is 5x the band: outside.
    assert "inside the band" in rows["LLM, Llama 886M"] and "2026-12-01" in rows["LLM, Llama 886M"]
    assert "OUTSIDE the band" in rows["LLM, Qwen3-1.7B"]
    assert "inside the band" in rows["GR00T-N1.6"]
    assert "inside the band" in rows["LLM, Moonlight-16B-A3B cut to 4 layers"]
    for model in ("VLM, Qwen2.5-VL-3B", "pi0.5", "diffusion, Wan2.1 T2V 1.3B"):
        assert "not measured on a GPU" in rows[model]
    pngs = sorted(p.name for p in tmp_path.glob("alignment_2026-12-07_*.png"))
    assert pngs == [f"alignment_2026-12-07_{k}.png" for k in sorted(found)]
    assert all(f"]({png})" in md for png in pngs)

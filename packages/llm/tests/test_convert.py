"""HF -> native (DCP) -> HF is bit-identical, and the export loads in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from longboat.core.distributed import run_multiprocess


def _cli_round_trip(rank: int, world: int, hf_dir: Path, native: Path, out: Path) -> list[int]:
    from longboat.llm.cli import main

    return [
        main(["convert", "hf-to-native", str(hf_dir), str(native)]),
        main(["convert", "native-to-hf", str(native), str(out)]),
    ]


def _tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    index = hf_dir / "model.safetensors.index.json"
    files = (
        sorted({hf_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.exists()
        else [hf_dir / "model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_hf_native_hf_round_trip_is_bit_identical(
    family: str, hf_dirs: dict[str, Path], tokens: torch.Tensor, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    src = hf_dirs[family]
    native, out = tmp_path / "native", tmp_path / "hf"
    assert run_multiprocess(_cli_round_trip, 1, src, native, out) == [[0, 0]]
    assert (native / "step_00000000" / "manifest.json").is_file()

    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), f"{name} changed in the round trip"

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    original = AutoModelForCausalLM.from_pretrained(src).eval()
    assert type(exported) is type(original)
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, original(tokens).logits)


def test_native_to_hf_without_checkpoint_is_clear(tmp_path: Path) -> None:
    from longboat.llm.cli import main

    assert main(["convert", "native-to-hf", str(tmp_path), str(tmp_path / "o")]) == 2

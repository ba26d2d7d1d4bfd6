"""Checkpoint / flavor mismatches fail listing every offending name, before any model is built."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from longboat.core.config.errors import ConfigError
from longboat.core.family import find_family
from longboat.core.megatron.hf_io import HFCheckpointMismatch, check_hf_checkpoint
from longboat.llm.hf_checkpoint import check_matches_flavor, read_hf_config


def test_every_bad_tensor_is_listed(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(hf_dirs["qwen3"], bad)
    sd = load_file(str(bad / "model.safetensors"))
    del sd["model.layers.1.self_attn.k_norm.weight"]
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    sd["model.layers.2.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})

    arch = read_hf_config(bad)
    with pytest.raises(HFCheckpointMismatch) as info:
        check_hf_checkpoint(bad, arch)
    problems = info.value.problems
    assert len(problems) == 3, problems
    text = str(info.value)
    for name in (
        "missing: model.layers.1.self_attn.k_norm.weight",
        "unexpected: model.layers.0.mlp.extra.weight",
        "shape: model.layers.2.mlp.up_proj.weight is [7, 64]",
    ):
        assert name in text


def test_clean_checkpoint_passes(hf_dirs: dict[str, Path]) -> None:
    for family, d in hf_dirs.items():
        index = check_hf_checkpoint(d, read_hf_config(d))
        assert len(index) > 10, family


def test_flavor_mismatch_lists_every_field(hf_dirs: dict[str, Path]) -> None:
    flavor = dataclasses.replace(
        find_family("llm", "llama3").flavor("tiny"), num_layers=3, hidden_size=32
    )
    with pytest.raises(ConfigError) as info:
        check_matches_flavor(flavor, read_hf_config(hf_dirs["llama3"]), "ckpt/config.json")
    text = str(info.value)
    assert "model.num_layers=3 but ckpt/config.json has 4" in text
    assert "model.hidden_size=32 but ckpt/config.json has 64" in text


def test_wrong_family_is_named(hf_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="'qwen3' checkpoint"):
        check_matches_flavor(
            find_family("llm", "llama3").flavor("tiny"), read_hf_config(hf_dirs["qwen3"]), "c.json"
        )


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type='gpt2' is not supported"):
        read_hf_config(tmp_path)

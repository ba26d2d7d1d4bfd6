"""``model.init_from=hf://<owner>/<name>`` fine-tunes a model from the Hugging Face hub
cache (laid out as ``huggingface_hub`` writes it; no network): the run sees the snapshot's
directory, its architecture and tokenizer; a model not in the cache is named with the
command that downloads it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from llm_testkit import make_hf_checkpoint

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError

SHA = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    ckpt, jsonl = make_hf_checkpoint(tmp_path / "user", "qwen3")
    repo = tmp_path / "hub" / "models--acme--tiny-qwen3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    snapshot = repo / "snapshots" / SHA
    shutil.copytree(ckpt, snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return {"snapshot": snapshot, "jsonl": jsonl}


def test_a_hub_model_id_is_its_cached_snapshot(hub: dict[str, Path]) -> None:
    cfg = compose_experiment(
        "sft", ["model.init_from=hf://acme/tiny-qwen3", f"data.paths=[{hub['jsonl']}]"],
        stack="llm", world_size=1,
    )  # fmt: skip
    assert cfg.model.init_from == str(hub["snapshot"])
    assert cfg.data.tokenizer == str(hub["snapshot"])
    assert cfg.model.name == "qwen3" and cfg.model.hidden_size == 64


def test_a_model_not_in_the_cache_is_named_with_its_download(hub: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as err:
        compose_experiment(
            "sft", ["model.init_from=hf://acme/missing", f"data.paths=[{hub['jsonl']}]"],
            stack="llm", world_size=1,
        )  # fmt: skip
    assert "model.init_from" in err.value.keys
    assert "not in the Hugging Face hub cache" in str(err.value)
    assert "huggingface-cli download acme/missing" in str(err.value)

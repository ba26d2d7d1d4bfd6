"""Bad settings of a run are named all at once, before any data is tokenised, in words that
fit what the user gave (raw files in ``data.paths``, not a data-prepare option)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llm_testkit import make_hf_dir

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

    root = tmp_path_factory.mktemp("msgs")
    out = make_hf_dir("qwen3", root / "qwen3-tiny")
    train_tiny_tokenizer(["boat sail wind"] * 10, out, vocab_size=256)
    return out


def _build(overrides: list[str], monkeypatch: pytest.MonkeyPatch) -> ConfigError:
    from longboat.llm.train.training import build_training

    monkeypatch.delenv("WORLD_SIZE", raising=False)  # a plain `longboat-llm train`: world 1
    cfg = compose_experiment("sft", overrides, stack="llm")
    with pytest.raises(ConfigError) as err:
        build_training(cfg)
    return err.value


def test_every_problem_is_named_at_once_before_tokenising(ckpt, tmp_path, monkeypatch) -> None:
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": "hi", "completion": "ho"}) + "\n")
    cache = tmp_path / "cache"
    err = _build(
        [f"model.init_from={ckpt}", f"data.paths=[{chats}]", f"data.cache_dir={cache}",
         "data.seq_len=100000", "parallel.tensor_parallel=2", f"lora.init_from={tmp_path}",
         "lora.enabled=true", f"output_dir={tmp_path / 'run'}"],
        monkeypatch,
    )  # fmt: skip
    assert set(err.keys) == {"data.seq_len", "parallel", "lora.init_from"}, err
    assert "world size 1 is not divisible by tp=2" in str(err), err
    assert not cache.exists(), "the layout is checked before the data is tokenised"


def test_no_data_paths_names_raw_files(ckpt, tmp_path, monkeypatch) -> None:
    err = _build([f"model.init_from={ckpt}", "data.paths=[]", f"output_dir={tmp_path}"],
                 monkeypatch)  # fmt: skip
    assert err.keys == ["data.paths"]
    assert "JSONL / JSON / Parquet / .txt files" in str(err) and "prepared dataset" not in str(err)


def test_an_unknown_file_type_names_data_paths(ckpt, tmp_path, monkeypatch) -> None:
    doc = tmp_path / "notes.docx"
    doc.write_bytes(b"PK")
    err = _build([f"model.init_from={ckpt}", f"data.paths=[{doc}]", f"output_dir={tmp_path}",
                  f"data.cache_dir={tmp_path / 'cache'}"], monkeypatch)  # fmt: skip
    assert err.keys == ["data.paths"] and "--input" not in str(err)
    assert (
        f"{doc}: unknown file type '.docx'; use .jsonl, .json (JSON lines), .parquet or .txt"
        in (str(err))
    )

"""A Hugging Face dataset id in ``data.paths`` (``hf://datasets/<owner>/<name>``) reads the
dataset's train split from the hub cache, laid out as ``huggingface_hub`` writes it (offline:
no download is attempted when the cache holds the snapshot)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longboat.llm.data import IndexedTokenDataset
from longboat.llm.data.raw import prepared_path
from longboat.llm.data.sources import resolve_input
from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

SHA = "0123456789abcdef0123456789abcdef01234567"


def _chats(n: int, offset: int = 0) -> list[dict]:
    return [{"prompt": f"what is {i + offset} plus one?", "completion": f"it is {i + offset + 1}"}
            for i in range(n)]  # fmt: skip


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    repo = cache / "datasets--acme--chats"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    data = repo / "snapshots" / SHA / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(_chats(6)), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(_chats(3, 100)), data / "test-00000-of-00001.parquet")
    (repo / "snapshots" / SHA / "README.md").write_text("# chats\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return data


def test_a_hub_dataset_id_reads_its_train_split_from_the_cache(hub: Path, tmp_path: Path) -> None:
    tok = train_tiny_tokenizer([c["prompt"] + c["completion"] for c in _chats(9)] * 3,
                               tmp_path / "tok")  # fmt: skip
    spec = resolve_input("hf://datasets/acme/chats")
    assert spec.kind == "parquet" and [f.name for f in spec.files] == [
        "train-00000-of-00001.parquet"
    ]
    kw = {"cache_dir": tmp_path / "cache", "log": lambda *_: None, "progress": False}
    got = IndexedTokenDataset(prepared_path("hf://datasets/acme/chats", tok, **kw))
    local = tmp_path / "train.jsonl"
    local.write_text("".join(json.dumps(c) + "\n" for c in _chats(6)))
    want = IndexedTokenDataset(prepared_path(local, tok, **kw))
    assert got.manifest["kind"] == "sft" and len(got) == 6
    assert [got[i].tolist() for i in range(6)] == [want[i].tolist() for i in range(6)]


def test_a_run_takes_a_hub_dataset_in_data_paths(hub: Path, tmp_path: Path) -> None:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import typed_config
    from longboat.llm.train.data import _prepared

    tok = train_tiny_tokenizer([c["prompt"] + c["completion"] for c in _chats(9)] * 3,
                               tmp_path / "tok")  # fmt: skip
    cfg = typed_config(compose_experiment(
        "quickstart", ["data=prepared", "data.paths=[hf://datasets/acme/chats]",
                       f"data.tokenizer={tok}", f"data.cache_dir={tmp_path / 'cache'}"],
        stack="llm", world_size=1))  # fmt: skip
    out = _prepared(Path(cfg.data.paths[0]), cfg.data, Path(tok), rank=0)
    assert IndexedTokenDataset(out).num_docs == 6

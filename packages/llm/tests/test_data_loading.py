"""Prepared datasets -> blended, packed training rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from longboat.core.data.packing import IGNORE_INDEX
from longboat.llm.data.loading import build_packed_dataset
from longboat.llm.data.prepare import PrepareOptions, prepare_dataset
from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("blend")
    a_texts = [f"alpha {i} " * (1 + i % 4) for i in range(30)]
    b_texts = [f"beta {i} " * (1 + i % 3) for i in range(10)]
    tok = train_tiny_tokenizer(a_texts + b_texts, root / "tok")
    out = []
    for name, texts in (("a", a_texts), ("b", b_texts)):
        inp = root / f"{name}.jsonl"
        inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        opts = PrepareOptions(input=inp, tokenizer=tok, output=root / name)
        out.append(prepare_dataset(opts, progress=False, log=lambda m: None).path)
    return out[0], out[1], tok


def test_single_dataset_packs_every_token(two_datasets) -> None:  # type: ignore[no-untyped-def]
    a, _, _ = two_datasets
    from longboat.llm.data import IndexedTokenDataset

    ds = IndexedTokenDataset(a)
    rows = build_packed_dataset([a], 32)
    assert rows.num_tokens == ds.num_tokens and rows.fill > 0.9
    n_labels = sum(int((r["labels"] != IGNORE_INDEX).sum()) for r in rows)
    assert n_labels == ds.num_tokens - len(ds)  # every next-token pair inside a document


def test_blend_proportions_and_determinism(two_datasets) -> None:  # type: ignore[no-untyped-def]
    a, b, _ = two_datasets
    rows = build_packed_dataset([a, b], 64, weights=[1, 3], num_samples=80, seed=5)
    again = build_packed_dataset([a, b], 64, weights=[1, 3], num_samples=80, seed=5)
    for i in range(len(rows)):
        np.testing.assert_array_equal(rows[i]["input_ids"], again[i]["input_ids"])
    src = rows.documents.source
    assert np.bincount(src, minlength=2).tolist() == [20, 60]


def test_mismatched_kinds_are_refused(two_datasets, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, _, tok = two_datasets
    inp = tmp_path / "c.jsonl"
    conv = [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "beta"}]
    inp.write_text(json.dumps({"messages": conv}) + "\n")
    sft = prepare_dataset(
        PrepareOptions(input=inp, tokenizer=tok, output=tmp_path / "c", format="sft"),
        progress=False,
        log=lambda m: None,
    ).path
    with pytest.raises(ValueError, match="differ in kind"):
        build_packed_dataset([a, sft], 32)

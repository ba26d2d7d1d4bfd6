"""Plain ``.txt`` files train as pretraining text: one document per paragraph (text between
blank lines), the tokens of the same paragraphs as ``{"text": ...}`` JSON lines; a folder of
them reads in name order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longboat.llm.data import IndexedTokenDataset
from longboat.llm.data.raw import detect_format, prepared_path
from longboat.llm.data.sources import resolve_input
from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

PARAGRAPHS = [
    "The tide came in at dawn.\nThe boats rose with it.",
    "Row, row, row the boat.",
    "Gulls cried over the harbour wall   \nand the nets dried in the sun.",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_tokenizer(PARAGRAPHS * 4, tmp_path_factory.mktemp("tok") / "tok")


def _docs(path: Path, tok_dir: Path, cache: Path) -> list[list[int]]:
    out = prepared_path(path, tok_dir, cache_dir=cache, log=lambda *_: None, progress=False)
    ds = IndexedTokenDataset(out)
    assert ds.manifest["kind"] == "pretrain"
    return [ds[i].tolist() for i in range(len(ds))]


def test_txt_paragraphs_are_the_documents(tok_dir: Path, tmp_path: Path) -> None:
    txt = tmp_path / "harbour.txt"
    txt.write_text("\n\n".join(PARAGRAPHS[:2]) + "\n \n\n" + PARAGRAPHS[2] + "\n\n\n")
    ref = tmp_path / "harbour.jsonl"
    ref.write_text("".join(json.dumps({"text": p.strip()}) + "\n" for p in PARAGRAPHS))
    assert resolve_input(txt).kind == "text"
    assert detect_format(resolve_input(txt)) == "pretrain"
    got = _docs(txt, tok_dir, tmp_path / "cache")
    assert len(got) == 3 and got == _docs(ref, tok_dir, tmp_path / "cache")

    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "b.txt").write_text(PARAGRAPHS[2])
    (folder / "a.txt").write_text("\n\n".join(PARAGRAPHS[:2]))
    assert _docs(folder, tok_dir, tmp_path / "cache") == got


def test_a_txt_file_that_is_not_utf8_is_named_with_its_line(tok_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "latin.txt"
    bad.write_bytes(b"first line\nsecond \xe9t\xe9\n")
    with pytest.raises(ValueError, match=r"latin\.txt:2: not UTF-8 text \(byte 0xe9"):
        prepared_path(bad, tok_dir, cache_dir=tmp_path / "c", log=lambda *_: None,
                      progress=False)  # fmt: skip

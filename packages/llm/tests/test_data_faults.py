"""Bad raw files end as one line naming the file and the line / rows (exit 2 on the command
line), and records dropped for a null text are counted and reported."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longboat.llm.data.cli import data_main
from longboat.llm.data.prepare import PrepareOptions, prepare_dataset
from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

TEXTS = [f"the quick brown fox {i} jumps over a lazy dog" for i in range(40)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_tokenizer(TEXTS, tmp_path_factory.mktemp("tok") / "tok")


def _prepare(inp: Path, tok: Path, out: Path) -> tuple:  # type: ignore[no-untyped-def]
    logs: list[str] = []
    opts = PrepareOptions(input=inp, tokenizer=tok, output=out)
    return prepare_dataset(opts, log=logs.append, progress=True), logs


def test_null_texts_are_counted_and_reported(tok_dir: Path, tmp_path: Path) -> None:
    rows = [{"text": TEXTS[0]}] + [{"text": None}] * 299
    inp = tmp_path / "n.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res, logs = _prepare(inp, tok_dir, tmp_path / "out")
    assert res.manifest["num_docs"] == 1
    assert res.manifest["report"]["skipped_null"] == 299
    assert f"{inp}: 299 of 300 records left out (299 with a null 'text')" in logs


def test_all_records_null_is_refused_with_the_count(tok_dir: Path, tmp_path: Path) -> None:
    inp = tmp_path / "all_null.jsonl"
    inp.write_text('{"text": null}\n' * 5)
    with pytest.raises(ValueError, match=r"5 of 5 records left out \(5 with a null 'text'\)"):
        _prepare(inp, tok_dir, tmp_path / "out")
    inp.write_text('{"text": null}\n{"text": 3}\n')  # a wrong type after a null still fails
    with pytest.raises(ValueError, match="record 1: text is int, not a string"):
        _prepare(inp, tok_dir, tmp_path / "out")


def test_non_utf8_jsonl_names_the_line_and_column(
    tok_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inp = tmp_path / "latin1.jsonl"
    inp.write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError) as err:
        _prepare(inp, tok_dir, tmp_path / "out")
    assert str(err.value).startswith(f"{inp}:3: not UTF-8 text (byte 0xe9 at column 14")
    args = ["prepare", "--input", str(inp), "--tokenizer", str(tok_dir), "--output", "o"]
    assert data_main([*args, "--no-progress"]) == 2
    err_text = capsys.readouterr().err.strip()
    assert (
        err_text.startswith(f"longboat-llm data: error: {inp}:3: not UTF-8")
        and "\n" not in err_text
    )


def _parquet(path: Path, n: int = 4000) -> Path:
    table = pa.table({"text": [f"{TEXTS[i % 40]} {i * 7919}" for i in range(n)]})
    pq.write_table(table, path, compression="snappy", row_group_size=1000)
    return path


def test_a_corrupted_snappy_parquet_names_the_file_and_rows(tok_dir: Path, tmp_path: Path) -> None:
    path = _parquet(tmp_path / "c.parquet")
    data = bytearray(path.read_bytes())
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(2).column(0)  # the third row group's data page
    start = col.data_page_offset + 120  # past the page header: the compressed values
    for i in range(start, start + 200):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        _prepare(path, tok_dir, tmp_path / "out")
    text = str(err.value)
    assert text.startswith(f"{path}: unreadable Parquet file after row ")
    assert "snappy" in text.lower() and "\n" not in text


def test_a_truncated_parquet_names_the_file(tok_dir: Path, tmp_path: Path) -> None:
    path = _parquet(tmp_path / "t.parquet")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"^{path}: unreadable Parquet file \("):
        _prepare(path, tok_dir, tmp_path / "out")

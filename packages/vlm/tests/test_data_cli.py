"""``longboat-vlm data inspect``: counts and a decoded row of a generated set; bad input exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from longboat.vlm.data.cli import data_main
from longboat.vlm.data.shapes_dataset import build_shapes_tokenizer, make_shapes_dataset

ARGS = ["--seq-len", "256", "--patch-size", "4", "--min-pixels", "3136", "--max-pixels", "3136"]


def test_inspect_prints_counts_and_a_row(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    made = make_shapes_dataset(tmp_path / "shapes", 12, seed=3)
    tok = build_shapes_tokenizer(tmp_path / "tok").path
    rc = data_main(["inspect", str(made.train), "--tokenizer", str(tok), *ARGS, "--rows", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"samples: {made.num_train}" in out
    assert f"images: {made.num_train}" in out
    assert "<|image_pad|>x49" in out  # 56x56 px, patch 4, merge 2 -> 7x7 merged tokens
    assert "[[" in out  # the assistant targets are marked


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tok = build_shapes_tokenizer(tmp_path / "tok").path
    rc = data_main(["inspect", str(tmp_path / "none.jsonl"), "--tokenizer", str(tok), *ARGS])
    assert rc == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_missing_image_names_row_and_field(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    made = make_shapes_dataset(tmp_path / "shapes", 6, seed=1)
    first = made.train.read_text().splitlines()[0]
    image = first.split('"image": "')[1].split('"')[0]
    (made.root / image).unlink()
    tok = build_shapes_tokenizer(tmp_path / "tok").path
    rc = data_main(["inspect", str(made.train), "--tokenizer", str(tok), *ARGS])
    err = capsys.readouterr().err
    assert rc == 2
    assert "row 0" in err and "image" in err and image in err

"""Bad conversation files fail in one line naming the file and the line / rows, and media
paths cannot lead outside the media root."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longboat.vlm.data.conversations import read_conversations
from longboat.vlm.data.errors import DataError


def _record(image: str | None = "a.png") -> dict:
    turns = [
        {"from": "human", "value": ("<image>\n" if image else "") + "what is it?"},
        {"from": "gpt", "value": "a square"},
    ]
    return {"image": image, "conversations": turns} if image else {"conversations": turns}


def test_non_utf8_jsonl_names_the_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    good = json.dumps(_record()).encode()
    path.write_bytes(good + b"\n" + b'{"conversations": "caf\xe9"}\n')
    with pytest.raises(DataError) as err:
        read_conversations(path)
    assert str(err.value).startswith(f"{path} line 2: not UTF-8 text (byte 0xe9 at column 23")
    assert err.value.exit_code == 2


def test_a_truncated_parquet_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.parquet"
    rows = [_record(None) for _ in range(600)]
    table = pa.table({"conversations": [json.dumps(r["conversations"]) for r in rows]})
    pq.write_table(table, path, row_group_size=100)
    assert len(read_conversations(path)) == 600
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(DataError, match=rf"^{path}: unreadable Parquet file \("):
        read_conversations(path)


@pytest.mark.parametrize(
    "name", ["../../../../etc/passwd", "../outside.png", "/etc/passwd", "sub/../../outside.png"]
)
def test_a_media_path_outside_the_root_is_refused(tmp_path: Path, name: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "outside.png").write_bytes(b"")
    path = data / "c.jsonl"
    path.write_text(json.dumps(_record()) + "\n" + json.dumps(_record(name)) + "\n")
    with pytest.raises(DataError) as err:
        read_conversations(path)
    text = str(err.value)
    assert text.startswith(f"{path} row 1 (line 2): field 'image': {name!r} resolves to ")
    assert f"outside the media root {data}" in text and "data.root" in text


def test_an_allow_listed_root_admits_its_files(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    path = data / "c.jsonl"
    image = tmp_path / "images" / "x.png"
    path.write_text(json.dumps(_record(str(image))) + "\n")
    with pytest.raises(DataError, match="outside the media root"):
        read_conversations(path)
    convs = read_conversations(path, root=tmp_path)  # data.root: the parent holds both
    assert convs[0].images[0].path == image
    frames = {"video": ["f0.png", "../f1.png"], "conversations": _record()["conversations"]}
    frames["conversations"][0]["value"] = "<video>\nwhat is it?"
    path.write_text(json.dumps(frames) + "\n")
    with pytest.raises(DataError, match=r"field 'video\[1\]': '\.\./f1\.png' resolves"):
        read_conversations(path)

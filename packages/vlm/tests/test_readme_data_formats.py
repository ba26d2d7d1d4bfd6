"""Every record the data table of the guide (``docs/vlm_guide.md``, linked from the README)
shows is read as the conversation it means: the LLaVA / ShareGPT, messages and content-part
forms give the same turns and image, the video form its video."""

from __future__ import annotations

import json
import re
from pathlib import Path

GUIDE = Path(__file__).parents[3] / "docs" / "vlm_guide.md"


def _table_records() -> dict[str, dict]:
    section = GUIDE.read_text().split("## Data formats", 1)[1].split("\n## ", 1)[0]
    out = {}
    for form, record in re.findall(r"^\| ([^|]+?) \| `(\{.*\})` \|$", section, flags=re.M):
        out[form] = json.loads(record)
    return out


def test_the_guides_records_read_as_they_mean(tmp_path: Path) -> None:
    from longboat.vlm.data.conversations import read_conversations

    records = _table_records()
    assert set(records) == {"LLaVA / ShareGPT", "messages", "messages with content parts",
                            "video"}  # fmt: skip
    got = {}
    for i, (form, record) in enumerate(records.items()):
        f = tmp_path / f"{i}.jsonl"
        f.write_text(json.dumps(record) + "\n")
        (conv,) = read_conversations(f)
        got[form] = conv
    want = (
        {"role": "user", "content": "<image>\nWhat is on the sofa?"},
        {"role": "assistant", "content": "Two cats."},
    )
    for form in ("LLaVA / ShareGPT", "messages", "messages with content parts"):
        conv = got[form]
        assert [m["role"] for m in conv.messages] == ["user", "assistant"], form
        assert conv.messages[1] == want[1], form
        text = conv.messages[0]["content"]
        assert text.count("<image>") == 1 and "What is on the sofa?" in text, form
        assert len(conv.images) == 1 and not conv.videos, form
    assert got["LLaVA / ShareGPT"].messages == want
    video = got["video"]
    assert len(video.videos) == 1 and not video.images
    assert video.messages[0]["content"] == "<video>\nWhat happens?"

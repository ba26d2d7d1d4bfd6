"""Readers of multimodal conversations: LLaVA / ShareGPT JSON, JSON lines, Parquet; images,
mp4 videos and frame folders; bad input named by row, file and field, or skipped and counted."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vlm_testkit import write_mp4

from longboat.core.errors import UserError
from longboat.vlm.data.conversations import read_conversations
from longboat.vlm.data.encoding import SampleEncoder, encode_conversations, load_tokenizer
from longboat.vlm.data.errors import BadMediaError, DataError, PlaceholderCountError
from longboat.vlm.data.media import VideoOptions, load_image, load_video
from longboat.vlm.data.processor import QwenVisionProcessor, VisionProcessorConfig
from longboat.vlm.data.tiny_tokenizer import build_vlm_tokenizer


def _rgb(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    info = build_vlm_tokenizer(
        ["What is in the image? a cat a dog", "Describe the video."],
        tmp_path_factory.mktemp("tok"),
        vocab_size=300,
    )
    return load_tokenizer(info.path)


@pytest.fixture
def media(tmp_path: Path) -> Path:
    Image.fromarray(_rgb(40, 60, 0)).save(tmp_path / "a.png")
    Image.fromarray(_rgb(50, 30, 1)).save(tmp_path / "b.jpg", quality=95)
    (tmp_path / "frames").mkdir()
    for i in range(4):
        Image.fromarray(np.full((32, 48, 3), 60 * i, np.uint8)).save(
            tmp_path / "frames" / f"{i:03d}.png"
        )
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    return tmp_path


def _turns(*texts: str) -> list[dict[str, str]]:
    roles = ["human", "gpt"]
    return [{"from": roles[i % 2], "value": t} for i, t in enumerate(texts)]


def test_llava_json_list_resolves_paths_and_roles(media: Path) -> None:
    data = [
        {"image": "a.png", "conversations": _turns("<image>\nWhat is it?", "a cat")},
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                *_turns("hi", "hello"),
            ]
        },
    ]
    (media / "data.json").write_text(json.dumps(data))
    convs = read_conversations(media / "data.json")
    assert [c.row for c in convs] == [0, 1]
    assert convs[0].images[0].path == media / "a.png"
    assert convs[0].images[0].field == "image"
    assert convs[0].messages == (
        {"role": "user", "content": "<image>\nWhat is it?"},
        {"role": "assistant", "content": "a cat"},
    )
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant"]
    assert convs[1].images == () and convs[1].videos == ()
    # Paths resolve against an explicit root instead of the file's folder.
    other = media / "sub"
    other.mkdir()
    (other / "data.json").write_text(json.dumps(data[:1]))
    assert read_conversations(other / "data.json", root=media)[0].images[0].path == media / "a.png"
    assert np.array_equal(np.asarray(load_image(convs[0].images[0], "x")), _rgb(40, 60, 0))


def test_messages_jsonl_with_content_parts_and_lists(media: Path) -> None:
    records = [
        {
            "images": ["a.png", "b.jpg"],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image"},
                        {"type": "text", "text": " and "},
                        {"type": "image"},
                        {"type": "text", "text": " differ how?"},
                    ],
                },
                {"role": "assistant", "content": "size"},
            ],
        },
        {"video": "frames", "messages": [{"role": "user", "content": "<video>"}]},
        {"video": ["frames/000.png", "frames/001.png"], "conversations": _turns("<video>", "x")},
    ]
    text = "\n".join(json.dumps(r) for r in records[:1]) + "\n\n" + json.dumps(records[1])
    (media / "d.jsonl").write_text(text + "\n" + json.dumps(records[2]) + "\n")
    convs = read_conversations(media / "d.jsonl")
    assert [(c.row, c.line) for c in convs] == [(0, 1), (1, 3), (2, 4)]
    assert convs[0].messages[0]["content"] == "<image> and <image> differ how?"
    assert [r.field for r in convs[0].images] == ["images[0]", "images[1]"]
    assert convs[1].videos[0].path == media / "frames"
    assert convs[2].videos[0].frames == (media / "frames/000.png", media / "frames/001.png")
    assert "d.jsonl row 1 (line 3)" in convs[1].where


def test_parquet_with_embedded_image_bytes(media: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    a, b = _rgb(30, 40, 2), _rgb(44, 28, 3)
    turns = [{"from": "human", "value": "<image>q"}, {"from": "gpt", "value": "ans"}]
    structs = pa.table(
        {
            "image": [
                {"bytes": _png_bytes(a), "path": "a.png"},
                {"bytes": _png_bytes(b), "path": None},
            ],
            "conversations": [turns, turns],
        }
    )
    pq.write_table(structs, media / "structs.parquet")
    raw = pa.table(
        {
            "image": [_png_bytes(b)],
            "messages": [json.dumps([{"role": "user", "content": "<image>"}])],
        }
    )
    pq.write_table(raw, media / "raw.parquet")
    convs = read_conversations(media / "structs.parquet") + read_conversations(
        media / "raw.parquet"
    )
    assert [c.row for c in convs] == [0, 1, 0]
    assert all(c.images[0].data is not None for c in convs)
    got = [np.asarray(load_image(c.images[0], c.where)) for c in convs]
    assert np.array_equal(got[0], a) and np.array_equal(got[1], b) and np.array_equal(got[2], b)
    # A folder of Parquet files reads them in name order.
    assert [c.source for c in read_conversations(media)] == [
        str(media / "raw.parquet"),
        str(media / "structs.parquet"),
        str(media / "structs.parquet"),
    ]


def test_videos_mp4_frame_folder_and_frame_list(media: Path) -> None:
    frames = [np.full((32, 48, 3), 30 * i, np.uint8) for i in range(6)]
    write_mp4(media / "clip.mp4", frames, fps=4)
    (media / "v.jsonl").write_text(
        "\n".join(
            json.dumps({"video": v, "conversations": _turns("<video>", "ok")})
            for v in ("clip.mp4", "frames", ["frames/002.png", "frames/003.png"])
        )
    )
    opts = VideoOptions(frames_fps=3.0)
    mp4, folder, listed = (
        load_video(c.videos[0], c.where, opts) for c in read_conversations(media / "v.jsonl")
    )
    assert len(mp4.frames) == 6 and mp4.fps == 4.0
    assert mp4.frames[0].shape == (32, 48, 3)
    # Lossy codec: flat frames come back within a few levels of their value.
    assert [round(float(f.mean()) / 30) for f in mp4.frames] == list(range(6))
    assert len(folder.frames) == 4 and folder.fps == 3.0
    assert [int(f[0, 0, 0]) for f in folder.frames] == [0, 60, 120, 180]
    assert [int(f[0, 0, 0]) for f in listed.frames] == [120, 180]


def test_mp4_sample_encodes_with_sampled_frames(media: Path, tokenizer) -> None:
    write_mp4(media / "clip.mp4", [np.full((56, 56, 3), 30 * i, np.uint8) for i in range(6)], fps=4)
    (media / "v.jsonl").write_text(
        json.dumps({"video": "clip.mp4", "conversations": _turns("<video>\nq", "ok")})
    )
    conv = read_conversations(media / "v.jsonl")[0]
    cfg = VisionProcessorConfig(video_min_pixels=56 * 56, video_max_pixels=56 * 56)
    encoder = SampleEncoder(tokenizer, QwenVisionProcessor(cfg), video=VideoOptions(fps=2.0))
    sample = encoder.encode(conv)
    # 6 frames at 4 fps = 1.5 s -> 3 frames at 2 fps, raised to min_frames=4: [0, 1.5, 3, 4.5]
    assert sample.video_frames == ((0, 1, 3, 4),)
    assert sample.video_grid_thw.tolist() == [[2, 4, 4]]
    assert sample.second_per_grid == (2 / (4 / 6 * 4.0),)
    px = encoder.pixels(sample)
    assert px["pixel_values_videos"].shape == (32, 3 * 2 * 14 * 14)


def _write_bad_set(media: Path) -> Path:
    records = [
        {"image": "a.png", "conversations": _turns("<image>\nq", "good")},
        {"image": "missing.png", "conversations": _turns("<image>\nq", "bad")},
        {"images": ["a.png", "corrupt.png"], "conversations": _turns("<image><image>", "bad")},
        {"video": "nope.mp4", "conversations": _turns("<video>", "bad")},
        {"image": "b.jpg", "conversations": _turns("<image>\nq", "good")},
    ]
    path = media / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bad_media_name_row_file_and_field(media: Path, tokenizer) -> None:
    path = _write_bad_set(media)
    convs = read_conversations(path)
    encoder = SampleEncoder(tokenizer, QwenVisionProcessor())
    with pytest.raises(BadMediaError) as missing:
        encoder.encode(convs[1])
    msg = str(missing.value)
    assert f"{path} row 1 (line 2)" in msg and "'image'" in msg
    assert str(media / "missing.png") in msg and "file not found" in msg
    assert isinstance(missing.value, UserError) and isinstance(missing.value, ValueError)
    assert missing.value.exit_code == 2
    with pytest.raises(BadMediaError) as corrupt:
        encoder.encode(convs[2])
    msg = str(corrupt.value)
    assert "row 2" in msg and "'images[1]'" in msg and "corrupt.png" in msg
    assert "not a readable image" in msg
    with pytest.raises(BadMediaError, match=r"row 3 .*'video'.*nope\.mp4"):
        encoder.encode(convs[3])
    # Corrupt embedded bytes (Parquet) name the row and the field too.
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(
        pa.table(
            {
                "image": [_png_bytes(_rgb(8, 8, 0)), b"\xff\xd8 truncated jpeg"],
                "conversations": [_turns("<image>", "x")] * 2,
            }
        ),
        media / "emb.parquet",
    )
    bad_bytes = read_conversations(media / "emb.parquet")[1]
    with pytest.raises(
        BadMediaError,
        match=r"emb\.parquet row 1: field 'image': <17 embedded bytes>: not a readable image",
    ):
        encoder.encode(bad_bytes)


def test_skip_bad_samples_counts_them(media: Path, tokenizer) -> None:
    convs = read_conversations(_write_bad_set(media))
    encoder = SampleEncoder(tokenizer, QwenVisionProcessor())
    with pytest.raises(BadMediaError):
        encode_conversations(convs, encoder)
    samples, report = encode_conversations(convs, encoder, skip_bad_samples=True)
    assert [s.where.split(" row ")[1][0] for s in samples] == ["0", "4"]
    assert report.as_dict() == {
        "records": 5,
        "samples": 2,
        "skipped_bad_media": 3,
        "truncated": 0,
        "dropped_overflow": 0,
        "dropped_no_assistant": 0,
    }
    assert len(report.bad) == 3
    for line, row, field in zip(
        report.bad, (1, 2, 3), ("image", "images[1]", "video"), strict=True
    ):
        assert f"row {row} " in line and f"field {field!r}" in line


def test_placeholder_count_mismatch_names_the_row(media: Path) -> None:
    records = [
        {"image": "a.png", "conversations": _turns("<image>\nq", "a")},
        {"images": ["a.png", "b.jpg"], "conversations": _turns("<image> one only", "a")},
    ]
    (media / "m.json").write_text(json.dumps(records))
    with pytest.raises(
        PlaceholderCountError, match=r"m\.json row 1: 1 <image> placeholder\(s\).*2 image"
    ):
        read_conversations(media / "m.json")
    (media / "v.json").write_text(json.dumps([{"conversations": _turns("<video> where?", "a")}]))
    with pytest.raises(PlaceholderCountError, match=r"v\.json row 0: 1 <video>.*0 video"):
        read_conversations(media / "v.json")


def test_malformed_records_name_the_row(media: Path) -> None:
    (media / "x.jsonl").write_text(
        json.dumps({"conversations": _turns("a", "b")}) + "\n{not json\n"
    )
    with pytest.raises(DataError, match=r"x\.jsonl row 1 \(line 2\): not valid JSON"):
        read_conversations(media / "x.jsonl")
    (media / "y.jsonl").write_text(json.dumps({"text": "no turns"}) + "\n")
    with pytest.raises(
        DataError, match=r"y\.jsonl row 0 \(line 1\): the record has no 'conversations'"
    ):
        read_conversations(media / "y.jsonl")
    (media / "z.jsonl").write_text(json.dumps({"conversations": [{"from": "bot", "value": "x"}]}))
    with pytest.raises(DataError, match=r"row 0 .*turn 0: role 'bot'"):
        read_conversations(media / "z.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        read_conversations(media / "absent.jsonl")


def test_corrupt_mp4_is_bad_media(media: Path) -> None:
    pytest.importorskip("av")
    (media / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 garbage" * 4)
    (media / "c.jsonl").write_text(
        json.dumps({"video": "broken.mp4", "conversations": _turns("<video>", "x")})
    )
    conv = read_conversations(media / "c.jsonl")[0]
    with pytest.raises(
        BadMediaError, match=r"row 0 \(line 1\): field 'video': .*broken\.mp4: not a readable video"
    ):
        load_video(conv.videos[0], conv.where, VideoOptions())


def test_processor_config_is_used_for_grids(media: Path, tokenizer) -> None:
    (media / "g.jsonl").write_text(
        json.dumps({"image": "a.png", "conversations": _turns("<image>", "x")})
    )
    conv = read_conversations(media / "g.jsonl")[0]
    cfg = VisionProcessorConfig(min_pixels=56 * 56, max_pixels=112 * 112)
    sample = SampleEncoder(tokenizer, QwenVisionProcessor(cfg)).encode(conv)
    want = QwenVisionProcessor(cfg).preprocess_images([Image.open(media / "a.png")])[
        "image_grid_thw"
    ]
    assert sample.image_grid_thw.tolist() == want.tolist()
    assert (
        int((sample.input_ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
        == int(want.prod()) // 4
    )

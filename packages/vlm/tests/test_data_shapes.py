"""The quickstart's shapes dataset and tokenizer: deterministic files whose answers match the
pixels, a small tokenizer that round-trips the text, and the whole pipeline on them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from longboat.vlm.data.encoding import load_tokenizer
from longboat.vlm.data.loading import load_packed_dataset
from longboat.vlm.data.processor import QwenVisionProcessor, VisionProcessorConfig
from longboat.vlm.data.shapes_dataset import (
    COLOURS,
    POSITIONS,
    QUESTIONS,
    answer,
    build_shapes_tokenizer,
    make_shapes_dataset,
    shapes_texts,
)
from longboat.vlm.data.tiny_tokenizer import SPECIAL_TOKENS


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_files_are_deterministic_split_and_reused(tmp_path: Path) -> None:
    a = make_shapes_dataset(tmp_path / "a", 30, seed=5)
    b = make_shapes_dataset(tmp_path / "b", 30, seed=5)
    c = make_shapes_dataset(tmp_path / "c", 30, seed=6)
    assert _digest(a.root) == _digest(b.root) != _digest(c.root)
    assert (a.num_train, a.num_held_out) == (27, 3)
    train, held = _records(a.train), _records(a.held_out)
    assert len(train) == 27 and len(held) == 3
    images = [r["image"] for r in train + held]
    assert len(set(images)) == 30 and all((a.root / i).is_file() for i in images)
    stamp = a.train.stat().st_mtime_ns
    again = make_shapes_dataset(tmp_path / "a", 30, seed=5)
    assert again == a and a.train.stat().st_mtime_ns == stamp  # reused, not rewritten
    for r in train:
        turns = r["conversations"]
        assert turns[0]["value"].startswith("<image>\n") and len(turns) in (2, 4)
        assert [t["from"] for t in turns] == ["human", "gpt"] * (len(turns) // 2)
    with pytest.raises(ValueError, match="at least 2"):
        make_shapes_dataset(tmp_path / "d", 1)


def test_answers_match_the_pixels(tmp_path: Path) -> None:
    ds = make_shapes_dataset(tmp_path, 60, seed=1, size=64)
    seen = set()
    for r in _records(ds.train) + _records(ds.held_out):
        meta = r["meta"]
        px = np.asarray(Image.open(ds.root / r["image"]).convert("RGB")).astype(int)
        assert px.shape == (64, 64, 3)
        shape_px = np.abs(px - np.asarray(COLOURS[meta["colour"]])).sum(-1) < 30
        background = (px == 255).all(-1)
        assert (shape_px | background).mean() > 0.97  # one colour on white (edges blend)
        yy, xx = np.nonzero(shape_px)
        fx, fy = POSITIONS[meta["position"]]
        cy = (yy.mean() + 0.5) / 64 if meta["shape"] != "triangle" else None
        assert abs((xx.mean() + 0.5) / 64 - fx) < 0.08
        if cy is not None:
            assert abs(cy - fy) < 0.08
        fill = shape_px.sum() / ((np.ptp(xx) + 1) * (np.ptp(yy) + 1))
        want = {"square": 1.0, "circle": np.pi / 4, "triangle": 0.5}[meta["shape"]]
        assert abs(fill - want) < 0.12, (meta, fill)
        turns = r["conversations"]
        for q, a in zip(turns[0::2], turns[1::2], strict=True):
            kind = next(k for k, text in QUESTIONS.items() if q["value"].endswith(text))
            assert a["value"] == answer(kind, meta["colour"], meta["shape"], meta["position"])
        seen.add((meta["colour"], meta["shape"], meta["position"]))
    assert len(seen) > 20  # of 5 * 3 * 4 = 60 combinations


def test_tokenizer_ids_and_round_trip(tmp_path: Path) -> None:
    info = build_shapes_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(info.path)
    assert info.vocab_size == len(tok) <= 512
    ids = tok.convert_tokens_to_ids
    assert info.image_token_id == ids("<|image_pad|>")
    assert info.video_token_id == ids("<|video_pad|>")
    assert info.vision_start_token_id == ids("<|vision_start|>")
    assert info.vision_end_token_id == ids("<|vision_end|>")
    assert info.pad_token_id == ids("<|endoftext|>") == tok.pad_token_id
    assert info.eos_token_id == ids("<|im_end|>") == tok.eos_token_id
    assert len({ids(t) for t in SPECIAL_TOKENS}) == len(SPECIAL_TOKENS)
    for text in shapes_texts():
        enc = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(enc) == text
    # Common words are single tokens after BPE: short sequences for the quickstart.
    assert len(tok("What colour is the shape?", add_special_tokens=False)["input_ids"]) <= 8
    markup = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
    assert tok(markup, add_special_tokens=False)["input_ids"] == [
        info.vision_start_token_id,
        info.image_token_id,
        info.image_token_id,
        info.vision_end_token_id,
    ]
    # The template renders string content and Qwen2-VL-style content parts alike.
    as_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    as_text = [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>hi"}]
    rendered = tok.apply_chat_template(as_parts, tokenize=False, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(as_text, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_pipeline_on_shapes_targets_are_the_answers(tmp_path: Path) -> None:
    ds = make_shapes_dataset(tmp_path / "shapes", 12, seed=0)
    info = build_shapes_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(info.path)
    proc = QwenVisionProcessor(VisionProcessorConfig(min_pixels=56 * 56, max_pixels=56 * 56))
    packed, report = load_packed_dataset(
        ds.train, tokenizer=tok, processor=proc, seq_len=160, tokens_per_second=2
    )
    assert report.samples == ds.num_train
    records = _records(ds.train)
    for r in range(len(packed)):
        row = packed[r]
        labels = row["labels"][0]
        got = tok.decode(labels[labels >= 0]).split("<|im_end|>\n")
        want = [t["value"] for i in row["sample_index"] for t in records[i]["conversations"][1::2]]
        assert got[:-1] == want and got[-1] == ""
        n_img = len(row["sample_index"])
        assert row["image_grid_thw"].tolist() == [[1, 4, 4]] * n_img  # 56 px -> 4 tokens each
        assert int((row["input_ids"] == info.image_token_id).sum()) == 4 * n_img
    assert sum(len(packed[r]["sample_index"]) for r in range(len(packed))) == ds.num_train


def test_inspect_shows_counts_vision_runs_and_targets(tmp_path: Path) -> None:
    from longboat.vlm.data.inspection import inspect_packed

    ds = make_shapes_dataset(tmp_path / "shapes", 6, seed=2)
    info = build_shapes_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(info.path)
    proc = QwenVisionProcessor(VisionProcessorConfig(min_pixels=56 * 56, max_pixels=56 * 56))
    packed, report = load_packed_dataset(
        ds.train, tokenizer=tok, processor=proc, seq_len=64, tokens_per_second=2, strategy="greedy"
    )
    text = inspect_packed(packed, tok, report=report, rows=1)
    first = _records(ds.train)[packed[0]["sample_index"][0]]["conversations"]
    assert "encoding: records=5, samples=5" in text
    assert f"rows: {len(packed)} of 64 tokens" in text and "images: 5" in text
    row_text = text.split("--- row 0: samples ")[1].split("\n", 1)[1]
    assert row_text.startswith(
        "<|im_start|>user\n<|vision_start|><|image_pad|>x4<|vision_end|>\n"
        f"{first[0]['value'].split(chr(10))[1]}<|im_end|>\n<|im_start|>assistant\n"
        f"[[{first[1]['value']}<|im_end|>\n]]"
    )


def test_questions_per_image_asks_every_kind_in_varying_order(tmp_path: Path) -> None:
    ds = make_shapes_dataset(tmp_path / "all", 20, seed=3, questions=4)
    firsts = set()
    for r in _records(ds.train) + _records(ds.held_out):
        turns = r["conversations"]
        assert [t["from"] for t in turns] == ["human", "gpt"] * 4
        asked = [q["value"].removeprefix("<image>\n") for q in turns[0::2]]
        assert sorted(asked) == sorted(QUESTIONS.values()) and "<image>" in turns[0]["value"]
        meta = r["meta"]
        kinds = {text: k for k, text in QUESTIONS.items()}
        for q, a in zip(asked, turns[1::2], strict=True):
            assert a["value"] == answer(kinds[q], meta["colour"], meta["shape"], meta["position"])
        firsts.add(asked[0])
    assert len(firsts) > 1
    assert _digest(ds.root) != _digest(make_shapes_dataset(tmp_path / "some", 20, seed=3).root)
    with pytest.raises(ValueError, match="questions=5"):
        make_shapes_dataset(tmp_path / "bad", 20, questions=5)

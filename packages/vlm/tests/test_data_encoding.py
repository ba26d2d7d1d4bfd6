"""Chat template, placeholder expansion and the assistant-only loss mask.

The expansion is checked against transformers' ``Qwen2_5_VLProcessor`` (same tokenizer,
transformers' image processor with the same settings): equal ``input_ids``, and equal
``pixel_values`` / ``image_grid_thw``. transformers' video processor needs torchvision,
absent here, so the reference processor is built with images only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from longboat.vlm.data.conversations import Conversation, MediaRef, read_conversations
from longboat.vlm.data.encoding import (
    SampleEncoder,
    VisionTokens,
    encode_conversations,
    load_tokenizer,
)
from longboat.vlm.data.errors import DataError, PlaceholderCountError, SampleTooLongError
from longboat.vlm.data.media import VideoOptions
from longboat.vlm.data.processor import QwenVisionProcessor, VisionProcessorConfig
from longboat.vlm.data.tiny_tokenizer import build_vlm_tokenizer

CFG = VisionProcessorConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    texts = ["user\nWhat colour is it?", "assistant\nred", "system\nBe brief.", "Where? left"]
    info = build_vlm_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=300)
    return load_tokenizer(info.path)


def _image(path: Path, h: int, w: int, seed: int) -> MediaRef:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return MediaRef("image", path=path)


def _conv(messages, images=(), videos=()) -> Conversation:
    return Conversation("mem.jsonl", 7, 8, tuple(messages), tuple(images), tuple(videos))


def _enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_mask_covers_assistant_turns_token_by_token(tokenizer, tmp_path: Path) -> None:
    img = _image(tmp_path / "a.png", 56, 84, 0)  # grid 1x4x6 -> 6 merged tokens
    conv = _conv(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "<image>\nWhat colour is it?"},
            {"role": "assistant", "content": "red"},
            {"role": "user", "content": "Where?"},
            {"role": "assistant", "content": "left"},
        ],
        [img],
    )
    encoder = SampleEncoder(tokenizer, QwenVisionProcessor(CFG))
    sample = encoder.encode(conv)
    ids = tokenizer.convert_tokens_to_ids
    s, e, nl = ids("<|im_start|>"), ids("<|im_end|>"), _enc(tokenizer, "\n")
    vs, ve, pad = ids("<|vision_start|>"), ids("<|vision_end|>"), ids("<|image_pad|>")
    want: list[tuple[int, int]] = []

    def add(tokens: list[int], target: int) -> None:
        want.extend((t, target) for t in tokens)

    for role, content, target in [
        ("system", [_enc(tokenizer, "Be brief.")], 0),
        ("user", [[vs] + [pad] * 6 + [ve], nl, _enc(tokenizer, "What colour is it?")], 0),
        ("assistant", [_enc(tokenizer, "red")], 1),
        ("user", [_enc(tokenizer, "Where?")], 0),
        ("assistant", [_enc(tokenizer, "left")], 1),
    ]:
        add([s, *_enc(tokenizer, role), *nl], 0)
        for part in content:
            add(part, target)
        add([e, *nl], target)  # the end-of-turn token (and the newline after it) counts
    assert sample.input_ids.tolist() == [t for t, _ in want]
    assert sample.loss_mask.tolist() == [m for _, m in want]
    assert sample.image_grid_thw.tolist() == [[1, 4, 6]]
    targets = tokenizer.decode(sample.input_ids[sample.loss_mask == 1])
    assert targets == "red<|im_end|>\nleft<|im_end|>\n"


class _ImageOnlyQwenProcessor:
    """transformers' Qwen2_5_VLProcessor without its (torchvision) video processor."""

    def __new__(cls, image_processor, tokenizer):
        from transformers import Qwen2_5_VLProcessor
        from transformers.processing_utils import ProcessorMixin

        class ImageOnly(Qwen2_5_VLProcessor):
            def __init__(self, image_processor=None, tokenizer=None, **kwargs):
                self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
                self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
                self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
                ProcessorMixin.__init__(
                    self, image_processor, tokenizer, chat_template=tokenizer.chat_template
                )

        return ImageOnly(image_processor=image_processor, tokenizer=tokenizer)


def test_expansion_matches_transformers_processor(tokenizer, tmp_path: Path) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    refs = [_image(tmp_path / "a.png", 60, 90, 1), _image(tmp_path / "b.png", 120, 50, 2)]
    refs[1] = MediaRef("images[1]", path=refs[1].path)
    messages = [
        {"role": "user", "content": "<image> and <image>\nWhat colour is it?"},
        {"role": "assistant", "content": "red"},
    ]
    encoder = SampleEncoder(tokenizer, QwenVisionProcessor(CFG))
    sample = encoder.encode(_conv(messages, refs))
    pixels = encoder.pixels(sample)

    hf = _ImageOnlyQwenProcessor(
        Qwen2VLImageProcessorPil(min_pixels=CFG.min_pixels, max_pixels=CFG.max_pixels), tokenizer
    )
    hf_messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": " and "},
                {"type": "image"},
                {"type": "text", "text": "\nWhat colour is it?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ]
    text = hf.apply_chat_template(hf_messages, tokenize=False)
    images = [Image.open(r.path) for r in refs]
    out = hf(images=images, text=[text], return_tensors="pt")
    assert sample.input_ids.tolist() == out["input_ids"][0].tolist()
    assert pixels["image_grid_thw"].tolist() == out["image_grid_thw"].tolist()
    assert pixels["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]]
    assert pixels["pixel_values"].shape == out["pixel_values"].shape
    assert bool((pixels["pixel_values"] == out["pixel_values"]).all())  # bit-exact


def test_video_tokens_follow_sampled_grid(tokenizer, tmp_path: Path) -> None:
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(8):
        Image.fromarray(np.full((56, 84, 3), 20 * i, np.uint8)).save(frames / f"{i}.png")
    (tmp_path / "v.jsonl").write_text(
        json.dumps(
            {
                "video": "frames",
                "conversations": [
                    {"from": "human", "value": "<video>\nWhat colour is it?"},
                    {"from": "gpt", "value": "red"},
                ],
            }
        )
    )
    conv = read_conversations(tmp_path / "v.jsonl")[0]
    cfg = VisionProcessorConfig(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 16)
    # 8 frames at 4 fps = 2 s; sampling at 2 fps keeps 4 frames -> 2 temporal grid steps.
    encoder = SampleEncoder(
        tokenizer, QwenVisionProcessor(cfg), video=VideoOptions(fps=2.0, frames_fps=4.0)
    )
    sample = encoder.encode(conv)
    assert sample.video_frames == ((0, 2, 4, 6),)
    assert sample.video_grid_thw.tolist() == [[2, 4, 6]]
    assert sample.second_per_grid == (1.0,)  # temporal_patch_size / sampled fps = 2 / 2
    video_pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert int((sample.input_ids == video_pad).sum()) == 2 * 4 * 6 // 4
    px = encoder.pixels(sample)
    assert px["pixel_values"] is None and px["video_grid_thw"].tolist() == [[2, 4, 6]]
    assert px["pixel_values_videos"].shape == (2 * 4 * 6, 3 * 2 * 14 * 14)
    by_count = SampleEncoder(
        tokenizer, QwenVisionProcessor(cfg), video=VideoOptions(fps=None, num_frames=2)
    ).encode(conv)
    assert by_count.video_frames == ((0, 4),) and by_count.video_grid_thw.tolist() == [[1, 4, 6]]
    assert by_count.second_per_grid == (2 / (2 / 8 * 2.0),)


def _long(tmp_path: Path) -> Conversation:
    img = _image(tmp_path / "a.png", 56, 56, 3)  # 4 merged tokens
    return _conv(
        [
            {"role": "user", "content": "What colour is it? <image>"},
            {"role": "assistant", "content": "red " * 30},
        ],
        [img],
    )


def test_overflow_error_drop_truncate(tokenizer, tmp_path: Path) -> None:
    encoder = SampleEncoder(tokenizer, QwenVisionProcessor(CFG))
    conv = _long(tmp_path)
    full = encoder.encode(conv)
    n = len(full)
    with pytest.raises(
        SampleTooLongError, match=rf"mem\.jsonl row 7 \(line 8\): {n} tokens \(4 of"
    ):
        encode_conversations([conv], encoder, max_len=n - 1)
    kept, report = encode_conversations([conv], encoder, max_len=n - 1, overflow="drop")
    assert kept == [] and report.dropped_overflow == 1
    kept, report = encode_conversations([conv], encoder, max_len=n - 5, overflow="truncate")
    assert report.truncated == 1 and len(kept[0]) == n - 5
    assert kept[0].input_ids.tolist() == full.input_ids[: n - 5].tolist()
    assert kept[0].loss_mask.tolist() == full.loss_mask[: n - 5].tolist()
    assert kept[0].image_grid_thw.tolist() == [[1, 4, 4]]
    # A cut inside the image's tokens is refused, naming the row.
    vs = int(np.flatnonzero(full.input_ids == encoder.tokens.vision_start_id)[0])
    with pytest.raises(SampleTooLongError, match=r"row 7 .*would split the image/video tokens"):
        encode_conversations([conv], encoder, max_len=vs + 2, overflow="truncate")
    # Cutting before the assistant turn leaves nothing to learn: dropped and counted.
    kept, report = encode_conversations([conv], encoder, max_len=3, overflow="truncate")
    assert kept == [] and report.dropped_no_assistant == 1 and report.truncated == 1


def test_text_holding_the_pad_token_is_an_error(tokenizer, tmp_path: Path) -> None:
    img = _image(tmp_path / "a.png", 56, 56, 4)
    conv = _conv(
        [
            {"role": "user", "content": "<image> and a stray <|image_pad|>"},
            {"role": "assistant", "content": "red"},
        ],
        [img],
    )
    with pytest.raises(PlaceholderCountError, match=r"row 7 .*2 image pad token\(s\).*1 image"):
        SampleEncoder(tokenizer, QwenVisionProcessor(CFG)).encode(conv)


def test_vision_tokens_from_tokenizer(tokenizer) -> None:
    t = VisionTokens.from_tokenizer(tokenizer)
    assert t.markup("image") == "<|vision_start|><|image_pad|><|vision_end|>"
    ids = {t.image_pad_id, t.video_pad_id, t.vision_start_id, t.vision_end_id}
    assert len(ids) == 4
    with pytest.raises(DataError, match=r"no token\(s\) \['<\|img\|>'\]"):
        VisionTokens.from_tokenizer(tokenizer, image_pad="<|img|>")


def test_checkpoint_and_tokenizer_must_number_vision_tokens_alike(tokenizer) -> None:
    import dataclasses

    from longboat.core.config.errors import ConfigError
    from longboat.vlm.models.qwen2_5_vl.model import flavor
    from longboat.vlm.train.data import _with_token_ids

    tokens = VisionTokens.from_tokenizer(tokenizer)
    cfg = flavor("tiny")
    got = _with_token_ids(cfg, tokens, len(tokenizer), "tok")  # a flavor takes the tokenizer's
    assert (got.image_token_id, got.vision_end_token_id) == (
        tokens.image_pad_id,
        tokens.vision_end_id,
    )
    # A checkpoint whose ids agree loads; one whose image id differs is refused, naming both.
    assert _with_token_ids(got, tokens, len(tokenizer), "tok", checkpoint="ckpt") == got
    other = dataclasses.replace(got, image_token_id=tokens.image_pad_id + 1)
    with pytest.raises(ConfigError, match="image_token_id: checkpoint") as err:
        _with_token_ids(other, tokens, len(tokenizer), "tok", checkpoint="ckpt")
    assert "data.tokenizer" in str(err.value)

"""LLaVA-OneVision videos in conversations: tokens equal to transformers'
``LlavaOnevisionProcessor`` and a packed row's loss equal to
``LlavaOnevisionForConditionalGeneration``'s (CPU, fp32, tiny shapes).

Videos are an mp4 (written with PyAV) and a frame folder. transformers' processor expands
each video placeholder to ``frames * ceil(grid / 2) ** 2 + 1`` tokens; it is given
transformers' PIL image processor and, in place of its torchvision video processor, our
video outputs (the frames themselves are checked against transformers' video processor in
``test_video_processing.py``). A packed row of two samples goes through longboat's model
and each sample alone through transformers' model: logits within 1e-4, the masked loss
within 1e-6 relative.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_testkit import random_frames, write_mp4

from longboat.core.distributed import run_multiprocess
from longboat.vlm.data.conversations import read_conversations
from longboat.vlm.data.encoding import SampleEncoder, encode_conversations, load_tokenizer
from longboat.vlm.data.errors import BadMediaError
from longboat.vlm.data.media import VideoOptions, load_video
from longboat.vlm.data.packing import PackedMultimodalDataset
from longboat.vlm.data.tiny_tokenizer import build_vlm_tokenizer
from longboat.vlm.models.llava_onevision.model import flavor, to_hf_config

TOL = 1e-4  # max abs logit difference vs transformers (fp32)
OPTIONS = VideoOptions(fps=2.0, frames_fps=3.0)
MODEL_INPUTS = ("input_ids", "position_ids", "pixel_values", "image_grid_thw",
                "pixel_values_videos", "video_grid_thw")  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tokenizer, the tiny config with its ids, an encoder and three conversations."""
    root = tmp_path_factory.mktemp("llava_video")
    info = build_vlm_tokenizer(["What moves? A ball moves left. Where is it?"], root / "tok",
                               vocab_size=300)  # fmt: skip
    tok = load_tokenizer(info.path)
    write_mp4(root / "clip.mp4", random_frames(10, 32, 48, 0), fps=5)  # 2 s
    (root / "frames").mkdir()
    for i, f in enumerate(random_frames(7, 30, 45, 1)):  # 7 frames at frames_fps=3
        Image.fromarray(f).save(root / "frames" / f"{i:02d}.png")
    Image.fromarray(random_frames(1, 20, 37, 3)[0]).save(root / "dog.png")
    turns = [
        {"conversations": [{"from": "human", "value": "<video>\nWhat moves?"},
                           {"from": "gpt", "value": "A ball."}],
         "video": "clip.mp4"},
        {"conversations": [{"from": "human", "value": "<image> <video> Where is it?"},
                           {"from": "gpt", "value": "left"}],
         "video": "frames", "image": "dog.png"},
        {"conversations": [{"from": "human", "value": "<video> What moves?"},
                           {"from": "gpt", "value": "A ball."}],
         "video": "missing.mp4"},
    ]  # fmt: skip
    (root / "clips.jsonl").write_text("\n".join(json.dumps(t) for t in turns))
    cfg = dataclasses.replace(
        flavor("tiny"), image_token_id=info.image_token_id, video_token_id=info.video_token_id
    )
    return {
        "root": root,
        "tok": tok,
        "cfg": cfg,
        "encoder": SampleEncoder(tok, cfg.vision_processor(), video=OPTIONS),
        "convs": read_conversations(root / "clips.jsonl"),
    }


class _OurVideos:
    """Stands in for transformers' torchvision video processor: our outputs, batched."""

    def __init__(self, pixel_values_videos: torch.Tensor) -> None:
        self.pixel_values_videos = pixel_values_videos

    def __call__(self, videos: Any, **kwargs: Any) -> dict[str, Any]:
        return {"pixel_values_videos": self.pixel_values_videos[None]}


def test_tokens_equal_transformers_processor(data: dict[str, Any]) -> None:
    from transformers import LlavaOnevisionProcessor
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin

    tok, encoder, cfg = data["tok"], data["encoder"], data["cfg"]
    conv = data["convs"][1]  # an image (alone: tiled) and a frame folder
    sample = encoder.encode(conv)
    assert sample.video_frames == ((0, 1, 3, 5),)  # 7 frames at 3 fps, 2 fps: i * 7 // 4
    pixels = encoder.pixels(sample)
    assert pixels["pixel_values_videos"].shape == (4, 3, 16, 16)
    assert sample.video_grid_thw.tolist() == [[4, 30, 45]]

    class WithOurVideos(LlavaOnevisionProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None) -> None:
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.num_image_tokens = cfg.vision.grid**2
            self.vision_feature_select_strategy = cfg.vision_feature_select_strategy
            self.vision_aspect_ratio = cfg.vision_aspect_ratio
            ProcessorMixin.__init__(
                self, image_processor, tokenizer, chat_template=tokenizer.chat_template
            )

    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": 16, "width": 16},
        image_grid_pinpoints=[list(p) for p in cfg.image_grid_pinpoints],
    )
    hf = WithOurVideos(image_processor=image_processor, tokenizer=tok)
    hf.video_processor = _OurVideos(pixels["pixel_values_videos"])
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " "},
                                     {"type": "video"}, {"type": "text", "text": " Where is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "left"}]},
    ]  # fmt: skip
    text = hf.apply_chat_template(messages, tokenize=False)
    video = np.stack(load_video(conv.videos[0], conv.where, OPTIONS).frames)
    image = Image.open(conv.images[0].path)
    out = hf(images=[image], videos=[video], text=[text], return_tensors="pt")
    assert sample.input_ids.tolist() == out["input_ids"][0].tolist()
    n_video = int((sample.input_ids == cfg.video_token_id).sum())
    assert n_video == 4 * 2 * 2 + 1  # 4 frames of 4x4 patches pooled to 2x2, one newline
    views = int(pixels["image_grid_thw"][0, 0])
    assert torch.equal(pixels["pixel_values"], out["pixel_values"][0, :views])  # bit-exact
    targets = tok.decode(sample.input_ids[sample.loss_mask == 1])
    assert targets == "left<|im_end|>\n"


def test_missing_video_names_row_file_field_or_is_skipped(data: dict[str, Any]) -> None:
    encoder, convs = data["encoder"], data["convs"]
    with pytest.raises(BadMediaError) as err:
        encoder.encode(convs[2])
    msg = str(err.value)
    assert "clips.jsonl row 2 (line 3)" in msg and "field 'video'" in msg
    assert str(data["root"] / "missing.mp4") in msg and "file not found" in msg
    samples, report = encode_conversations(convs, encoder, skip_bad_samples=True)
    assert len(samples) == 2 and report.skipped_bad_media == 1


def _worker(rank: int, world: int, hf_dir: Path, row: dict[str, Any]) -> dict[str, Any]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.vlm.models.llava_onevision.model import build, load_hf, read_hf_config

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"))
    try:
        model = build(cfg)
        load_hf(model, cfg, hf_dir)
        model.eval()
        inputs = {k: row[k] for k in MODEL_INPUTS}
        cu = row["cu_seqlens"].tolist()
        with torch.no_grad():
            logits = model(**inputs, cu_seqlens=cu)
            per_token = model(**inputs, cu_seqlens=cu, labels=row["labels"].clamp(min=0))
        mask = row["loss_mask"]
        return {"logits": logits, "loss": float((per_token * mask).sum() / mask.sum())}
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_packed_row_loss_equals_transformers(data: dict[str, Any], tmp_path: Path) -> None:
    from transformers import LlavaOnevisionForConditionalGeneration

    cfg, encoder = data["cfg"], data["encoder"]
    samples, _ = encode_conversations(data["convs"][:2], encoder)
    seq_len = sum(len(s) for s in samples) + 3  # both samples in one row, some padding
    dataset = PackedMultimodalDataset(samples, encoder, seq_len=seq_len, pad_id=0,
                                      tokens_per_second=1, positions=cfg.position_kind)  # fmt: skip
    assert len(dataset) == 1 and dataset.positions == "1d"
    row = dataset[0]
    assert row["video_grid_thw"][:, 0].tolist() == [4, 4]  # mp4: 10 frames at 5 fps -> 4
    hf_cfg = to_hf_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():  # norms away from 1, so a dropped one shows
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.08)
            if "norm" in name:
                p.add_(1.0)
            if "post_layernorm" in name:  # not part of a LLaVA tower's output
                p.fill_(1.0 if name.endswith("weight") else 0.0)
    model.save_pretrained(tmp_path / "hf")
    ours = run_multiprocess(_worker, 1, tmp_path / "hf", row, timeout=300)[0]

    cu = row["cu_seqlens"].tolist()
    num = den = 0.0
    for k, index in enumerate(row["sample_index"]):
        a, b = cu[k], cu[k + 1]
        media = encoder.pixels(samples[index])
        batch: dict[str, Any] = {"pixel_values_videos": media["pixel_values_videos"][None]}
        if media["pixel_values"] is not None:
            batch |= {"pixel_values": media["pixel_values"][None],
                      "image_sizes": media["image_grid_thw"][:, 1:],
                      "batch_num_images": torch.tensor([1])}  # fmt: skip
        with torch.no_grad():
            logits = model(input_ids=row["input_ids"][:, a:b], **batch).logits
        diff = (ours["logits"][:, a:b] - logits).abs().max().item()
        assert diff < TOL, f"sample {k}: max |dlogit| {diff:.2e}"
        mask = row["loss_mask"][0, a:b]
        ce = torch.nn.functional.cross_entropy(
            logits[0], row["labels"][0, a:b].clamp(min=0), reduction="none"
        )
        num, den = num + float((ce * mask).sum()), den + float(mask.sum())
    assert abs(ours["loss"] - num / den) < 1e-6 * (num / den), (ours["loss"], num / den)

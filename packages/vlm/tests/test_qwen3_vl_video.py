"""Qwen3-VL videos in conversations: tokens equal to transformers' ``Qwen3VLProcessor`` and a
packed row's loss equal to ``Qwen3VLForConditionalGeneration``'s (CPU, fp32, tiny shapes).

Videos are an mp4 (written with PyAV) and a frame folder. The token ids are checked
against transformers' own ``Qwen3VLProcessor`` (its text expansion: a ``<t seconds>`` text
and vision start / pads / end per frame group, inside the template's start / end) given
transformers' PIL image processor and, in place of its torchvision video processor, our
video outputs with the sampled frames' metadata (the frames themselves are checked against
transformers' video processor in ``test_video_processing.py``). A packed row of two such
samples goes through longboat's model and each sample alone through transformers' model:
logits within 1e-4, the masked loss within 1e-6 relative, and the row's position ids equal
to transformers' ``get_rope_index`` of each sample.
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
from longboat.vlm.data.errors import BadMediaError, SampleTooLongError
from longboat.vlm.data.media import VideoOptions, load_video
from longboat.vlm.data.packing import PackedMultimodalDataset
from longboat.vlm.data.tiny_tokenizer import build_vlm_tokenizer
from longboat.vlm.models.mrope import token_types
from longboat.vlm.models.qwen3_vl.model import flavor, to_hf_config
from longboat.vlm.models.qwen3_vl.processor import qwen3_vl_processor

TOL = 1e-4  # max abs logit difference vs transformers (fp32)
VIDEO = dict(video_min_pixels=256, video_max_pixels=4 * 8 * 8 * 6)  # 4 frames of <= 384 px
OPTIONS = VideoOptions(fps=2.0, frames_fps=3.0)
MODEL_INPUTS = ("input_ids", "position_ids", "pixel_values", "image_grid_thw",
                "pixel_values_videos", "video_grid_thw")  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tokenizer, the tiny config with its ids, an encoder and three conversations."""
    root = tmp_path_factory.mktemp("qwen3_video")
    texts = ["What moves? A ball moves left. <0.3 seconds> <1.5 seconds> Where is it?"]
    info = build_vlm_tokenizer(texts, root / "tok", vocab_size=300)
    tok = load_tokenizer(info.path)
    write_mp4(root / "clip.mp4", random_frames(10, 32, 48, 0), fps=5)  # 2 s
    (root / "frames").mkdir()
    for i, f in enumerate(random_frames(7, 30, 45, 1)):  # 7 frames at frames_fps=3
        Image.fromarray(f).save(root / "frames" / f"{i:02d}.png")
    (root / "one").mkdir()
    Image.fromarray(random_frames(1, 30, 45, 2)[0]).save(root / "one" / "0.png")
    Image.fromarray(random_frames(1, 40, 24, 3)[0]).save(root / "dog.png")
    turns = [
        {"conversations": [{"from": "human", "value": "<video>\nWhat moves? <image>"},
                           {"from": "gpt", "value": "A ball."}],
         "video": "clip.mp4", "image": "dog.png"},
        {"conversations": [{"from": "human", "value": "<video> Where is it?"},
                           {"from": "gpt", "value": "left"},
                           {"from": "human", "value": "What moves?"},
                           {"from": "gpt", "value": "A ball moves left."}],
         "video": "frames"},
        {"conversations": [{"from": "human", "value": "<video> What moves?"},
                           {"from": "gpt", "value": "A ball."}],
         "video": "one"},
    ]  # fmt: skip
    (root / "clips.jsonl").write_text("\n".join(json.dumps(t) for t in turns))
    cfg = dataclasses.replace(
        flavor("tiny"),
        image_token_id=info.image_token_id,
        video_token_id=info.video_token_id,
        vision_start_token_id=info.vision_start_token_id,
        vision_end_token_id=info.vision_end_token_id,
    )
    processor = qwen3_vl_processor(cfg.vision, 64, 8 * 8 * 6, **VIDEO)
    return {
        "root": root,
        "tok": tok,
        "cfg": cfg,
        "encoder": SampleEncoder(tok, processor, video=OPTIONS),
        "convs": read_conversations(root / "clips.jsonl"),
    }


class _OurVideos:
    """Stands in for transformers' torchvision video processor: our outputs + metadata."""

    def __init__(self, outputs: dict[str, Any], metadata: list[Any], cfg: Any) -> None:
        self.outputs, self.metadata = outputs, metadata
        self.merge_size, self.temporal_patch_size = cfg.merge_size, cfg.temporal_patch_size

    def __call__(self, videos: Any, **kwargs: Any) -> dict[str, Any]:
        return {**self.outputs, "video_metadata": self.metadata}


def _hf_processor(tok: Any, encoder: SampleEncoder, video_processor: _OurVideos) -> Any:
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin

    c = encoder.processor.config
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=c.patch_size, temporal_patch_size=c.temporal_patch_size,
        merge_size=c.merge_size, min_pixels=c.min_pixels, max_pixels=c.max_pixels,
        image_mean=list(c.image_mean), image_std=list(c.image_std),
    )  # fmt: skip

    class WithOurVideos(Qwen3VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None) -> None:
            for kind in ("image_pad", "video_pad", "vision_start", "vision_end"):
                name = "image" if kind == "image_pad" else "video" if kind == "video_pad" else kind
                setattr(self, f"{name}_token", f"<|{kind}|>")
                setattr(self, f"{name}_token_id", tokenizer.convert_tokens_to_ids(f"<|{kind}|>"))
            ProcessorMixin.__init__(
                self, image_processor, tokenizer, chat_template=tokenizer.chat_template
            )

    hf = WithOurVideos(image_processor=image_processor, tokenizer=tok)
    hf.video_processor = video_processor
    return hf


def test_tokens_equal_transformers_processor(data: dict[str, Any]) -> None:
    from transformers.video_utils import VideoMetadata

    tok, encoder = data["tok"], data["encoder"]
    conv = data["convs"][0]  # an mp4 (10 frames at 5 fps) and an image
    sample = encoder.encode(conv)
    assert sample.video_frames == ((0, 3, 6, 9),)  # 2 fps: 4 frames from first to last
    pixels = encoder.pixels(sample)
    video = load_video(conv.videos[0], conv.where, OPTIONS)
    meta = VideoMetadata(total_num_frames=len(video.frames), fps=video.fps,
                         frames_indices=list(sample.video_frames[0]))  # fmt: skip
    outputs = {k: pixels[k] for k in ("pixel_values_videos", "video_grid_thw")}
    hf = _hf_processor(tok, encoder, _OurVideos(outputs, [meta], encoder.processor.config))
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "\nWhat moves? "},
                                     {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A ball."}]},
    ]  # fmt: skip
    text = hf.apply_chat_template(messages, tokenize=False)
    image = Image.open(conv.images[0].path)
    out = hf(images=[image], videos=[np.stack(video.frames)], text=[text], return_tensors="pt")
    assert sample.input_ids.tolist() == out["input_ids"][0].tolist()
    types = token_types(torch.from_numpy(sample.input_ids), tok.convert_tokens_to_ids(
        "<|image_pad|>"), tok.convert_tokens_to_ids("<|video_pad|>"))  # fmt: skip
    assert types.tolist() == out["mm_token_type_ids"][0].tolist()
    assert torch.equal(pixels["pixel_values"], out["pixel_values"])  # bit-exact
    decoded = tok.decode(sample.input_ids)
    grid = sample.video_grid_thw[0].tolist()
    assert grid == [2, 4, 6]  # 4 frames of 16x24 (the pixel budget over all frames)
    pads = "<|video_pad|>" * (grid[1] * grid[2] // 4)
    want = (f"<|vision_start|><0.3 seconds><|vision_start|>{pads}<|vision_end|>"
            f"<1.5 seconds><|vision_start|>{pads}<|vision_end|><|vision_end|>")  # fmt: skip
    assert want in decoded
    # The inserted timestamp tokens belong to the user turn: no targets there.
    targets = tok.decode(sample.input_ids[sample.loss_mask == 1])
    assert targets == "A ball.<|im_end|>\n"


def test_frame_folder_video_and_assistant_timestamps_mask(data: dict[str, Any]) -> None:
    tok, encoder = data["tok"], data["encoder"]
    conv = dataclasses.replace(data["convs"][1], messages=(
        {"role": "user", "content": "Where is it?"},
        {"role": "assistant", "content": "<video> left"},
    ))  # fmt: skip
    sample = encoder.encode(conv)
    assert sample.video_frames == ((0, 2, 4, 6),)  # 7 frames at 3 fps, 2 fps sampling
    ids, mask = sample.input_ids, sample.loss_mask
    vid = tok.convert_tokens_to_ids("<|video_pad|>")
    # A video in an assistant turn: its timestamps and start / end are targets, pads never.
    assert mask[ids == vid].sum() == 0
    targets = tok.decode(ids[(mask == 1) & (ids != vid)])
    assert targets.startswith("<|vision_start|><0.3 seconds><|vision_start|><|vision_end|>")
    assert "<1.7 seconds>" in targets and targets.endswith(" left<|im_end|>\n")


def test_truncation_never_splits_a_video(data: dict[str, Any]) -> None:
    tok, encoder = data["tok"], data["encoder"]
    conv = dataclasses.replace(data["convs"][0], messages=(
        {"role": "user", "content": "<video>\nWhat moves?"},
        {"role": "assistant", "content": "A ball."},
        {"role": "user", "content": "<image> Where is it?"},
        {"role": "assistant", "content": "left"},
    ))  # fmt: skip
    full = encoder.encode(conv)
    ids = full.input_ids
    vs, ve = (tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    starts, ends = np.flatnonzero(ids == vs), np.flatnonzero(ids == ve)
    outer, end, image = int(starts[0]), int(ends[2]), int(starts[3])
    assert ids[outer + 1] != vs and ids[end - 1] == ve  # the nested video block's bounds
    for cut in (outer + 5, end - 1):  # inside a frame group; between the inner and outer end
        with pytest.raises(SampleTooLongError, match=rf"split the image/video tokens at "
                                                      rf"\[{outer}, {end}\]"):  # fmt: skip
            encode_conversations([conv], encoder, max_len=cut, overflow="truncate")
    # Cut before the image: the video and the first answer stay, the image goes.
    (kept,), report = encode_conversations([conv], encoder, max_len=image, overflow="truncate")
    assert report.truncated == 1 and len(kept) == image
    assert kept.videos == full.videos and kept.video_frames == full.video_frames
    assert kept.video_grid_thw.tolist() == full.video_grid_thw.tolist()
    assert len(kept.images) == 0 and kept.image_grid_thw.shape == (0, 3)
    assert len(full.images) == 1


def test_too_short_video_names_row_file_field_or_is_skipped(data: dict[str, Any]) -> None:
    encoder, convs = data["encoder"], data["convs"]
    with pytest.raises(BadMediaError) as err:
        encoder.encode(convs[2])  # a one-frame folder: no temporal patch of 2 frames
    msg = str(err.value)
    assert "clips.jsonl row 2 (line 3)" in msg and "field 'video'" in msg
    assert str(data["root"] / "one") in msg and "shorter than temporal_patch_size=2" in msg
    samples, report = encode_conversations(convs, encoder, skip_bad_samples=True)
    assert len(samples) == 2 and report.skipped_bad_media == 1


def _worker(rank: int, world: int, hf_dir: Path, row: dict[str, Any]) -> dict[str, Any]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.vlm.models.qwen3_vl.model import build, load_hf, read_hf_config

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"))
    try:
        model = build(cfg)
        load_hf(model, cfg, hf_dir)
        model.eval()
        inputs = {k: row[k] for k in MODEL_INPUTS}
        with torch.no_grad():
            logits = model(**inputs, cu_seqlens=row["cu_seqlens"].tolist())
            per_token = model(**inputs, cu_seqlens=row["cu_seqlens"].tolist(),
                              labels=row["labels"].clamp(min=0))  # fmt: skip
        mask = row["loss_mask"]
        return {"logits": logits, "loss": float((per_token * mask).sum() / mask.sum())}
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_packed_row_loss_equals_transformers(data: dict[str, Any], tmp_path: Path) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    cfg, encoder = data["cfg"], data["encoder"]
    samples, _ = encode_conversations(data["convs"][:2], encoder)
    # Positions as a run picks them: the family's config says Qwen3-VL's frame-group layout.
    seq_len = sum(len(s) for s in samples) + 3  # both samples in one row, some padding
    dataset = PackedMultimodalDataset(samples, encoder, seq_len=seq_len, pad_id=0,
                                      tokens_per_second=1, positions=cfg.position_kind)  # fmt: skip
    assert len(dataset) == 1 and dataset.positions == "mrope_frames"
    row = dataset[0]
    hf_cfg = to_hf_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():  # norms away from 1, so a dropped one shows
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.08)
            if "norm" in name:
                p.add_(1.0)
    model.save_pretrained(tmp_path / "hf")
    ours = run_multiprocess(_worker, 1, tmp_path / "hf", row, timeout=300)[0]

    cu = row["cu_seqlens"].tolist()
    num = den = 0.0
    for k, index in enumerate(row["sample_index"]):
        a, b = cu[k], cu[k + 1]
        ids = row["input_ids"][:, a:b]
        media = encoder.pixels(samples[index])
        batch = {key: value for key, value in media.items() if value is not None}
        types = token_types(ids, cfg.image_token_id, cfg.video_token_id).int()
        want_pos, _ = model.model.get_rope_index(
            ids, types, image_grid_thw=batch.get("image_grid_thw"),
            video_grid_thw=batch.get("video_grid_thw"),
        )  # fmt: skip
        assert torch.equal(row["position_ids"][:, :, a:b], want_pos), f"positions of sample {k}"
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=types, **batch).logits
        diff = (ours["logits"][:, a:b] - logits).abs().max().item()
        assert diff < TOL, f"sample {k}: max |dlogit| {diff:.2e}"
        mask = row["loss_mask"][0, a:b]
        ce = torch.nn.functional.cross_entropy(
            logits[0], row["labels"][0, a:b].clamp(min=0), reduction="none"
        )
        num, den = num + float((ce * mask).sum()), den + float(mask.sum())
    assert abs(ours["loss"] - num / den) < 1e-6 * (num / den), (ours["loss"], num / den)
    assert row["video_grid_thw"].tolist() == [[2, 4, 6], [2, 4, 6]]

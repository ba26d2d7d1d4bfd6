"""Conversations -> token ids, assistant-only loss mask and vision grids.

Rendering: every ``<image>`` / ``<video>`` placeholder becomes
``<|vision_start|><|image_pad|><|vision_end|>`` (``<|video_pad|>`` for videos), the turns
go through the tokenizer's own chat template (``apply_chat_template``), and each pad token
is then repeated ``grid_t * grid_h * grid_w // merge_size**2`` times — one per merged patch,
the grid being the processor's for that image or video. This is what transformers'
``Qwen2_5_VLProcessor`` does to text holding the same markup. A video's pad is replaced by
what its family's processor writes (``video_placeholder``): LLaVA-OneVision counts pooled
frame tokens, Qwen3-VL writes each frame group as ``<t seconds>`` text plus its own vision
start, pads and end; inserted text takes the mask of the turn it sits in.

Loss mask (1 = the token is a training target): exactly the characters each assistant turn
adds to the conversation, i.e. the render of ``messages[: i + 1]`` minus the render of
``messages[:i]`` with the generation prompt (the assistant's content and its end-of-turn
token, plus whatever the template appends to the turn), mapped to tokens through the
offset mapping. Vision pad tokens are never targets. Packing turns this mask into
megatron's next-token convention (``labels[i] = input_ids[i + 1]``, counted where the mask
of token ``i + 1`` is set; ``longboat.core.data.packing.build_row``).

Media are decoded once when a sample is encoded (so a missing or corrupt file is found up
front, and can be skipped and counted) and again when its packed row is built; pixels are
not kept in memory between the two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from longboat.core.data.chat import assistant_masked_ids
from longboat.vlm.data.conversations import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Conversation
from longboat.vlm.data.conversations import MediaRef as MediaRef
from longboat.vlm.data.errors import (
    BadMediaError,
    DataError,
    PlaceholderCountError,
    SampleTooLongError,
)
from longboat.vlm.data.media import VideoOptions, load_image, load_video
from longboat.vlm.data.processor import QwenVisionProcessor

__all__ = [
    "EncodedSample",
    "EncodingReport",
    "Overflow",
    "SampleEncoder",
    "VisionTokens",
    "encode_conversations",
    "load_tokenizer",
    "render_conversation",
]

Overflow = Literal["error", "drop", "truncate"]


def load_tokenizer(path: Any) -> Any:
    """A ``transformers`` tokenizer from a local directory (never the hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@dataclass(frozen=True, kw_only=True)
class VisionTokens:
    """The vision special tokens of a tokenizer: strings and ids."""

    image_pad: str = "<|image_pad|>"
    video_pad: str = "<|video_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    image_pad_id: int
    video_pad_id: int
    vision_start_id: int
    vision_end_id: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **names: str) -> VisionTokens:
        """Look the tokens up (Qwen's names unless overridden); raises naming a missing one."""
        strings = {
            "image_pad": "<|image_pad|>",
            "video_pad": "<|video_pad|>",
            "vision_start": "<|vision_start|>",
            "vision_end": "<|vision_end|>",
        } | names
        vocab = tokenizer.get_vocab()
        missing = [s for s in strings.values() if s not in vocab]
        if missing:
            raise DataError(
                f"the tokenizer has no token(s) {missing}; use a tokenizer with Qwen-VL's "
                "vision tokens (e.g. the quickstart's build_vlm_tokenizer) or name its own"
            )
        return cls(**strings, **{f"{k}_id": int(vocab[s]) for k, s in strings.items()})

    def markup(self, kind: Literal["image", "video"]) -> str:
        """``<|vision_start|><|image_pad|><|vision_end|>`` (or the video pad)."""
        pad = self.image_pad if kind == "image" else self.video_pad
        return self.vision_start + pad + self.vision_end


def render_conversation(
    tokenizer: Any, messages: Sequence[dict[str, str]], tokens: VisionTokens, at: str = "sample"
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (one pad token per image / video) and the 0/1 assistant-target mask."""
    messages = [
        {
            "role": m["role"],
            "content": m["content"]
            .replace(IMAGE_PLACEHOLDER, tokens.markup("image"))
            .replace(VIDEO_PLACEHOLDER, tokens.markup("video")),
        }
        for m in messages
    ]
    return assistant_masked_ids(tokenizer, messages, at=at, error=DataError)


def _pads(ids: np.ndarray, pad_id: int, n: int, what: str, at: str) -> np.ndarray:
    where_pad = np.flatnonzero(ids == pad_id)
    if len(where_pad) != n:
        raise PlaceholderCountError(
            f"{at}: the rendered conversation holds {len(where_pad)} {what} pad token(s) but the "
            f"record has {n} {what}(s); the text must not contain the pad token itself "
            "and the chat template must keep every placeholder"
        )
    return where_pad


def _expand(
    ids: np.ndarray, mask: np.ndarray, pad_id: int, counts: Sequence[int], what: str, at: str
) -> tuple[np.ndarray, np.ndarray]:
    where_pad = _pads(ids, pad_id, len(counts), what, at)
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[where_pad] = np.asarray(counts, dtype=np.int64)
    ids = np.repeat(ids, repeats)
    mask = np.repeat(mask, repeats)
    mask[ids == pad_id] = 0
    return ids, mask


def _splice(
    ids: np.ndarray,
    mask: np.ndarray,
    pad_id: int,
    pieces: Sequence[Sequence[int]],
    what: str,
    at: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Each pad token replaced by its piece; the piece's tokens take the pad's mask (the
    surrounding turn's), pads themselves are never targets."""
    where_pad = _pads(ids, pad_id, len(pieces), what, at)
    out_ids, out_mask, last = [], [], 0
    for pos, piece in zip(where_pad, pieces, strict=True):
        out_ids += [ids[last:pos], np.asarray(piece, dtype=ids.dtype)]
        out_mask += [mask[last:pos], np.full(len(piece), mask[pos], dtype=mask.dtype)]
        last = pos + 1
    ids = np.concatenate([*out_ids, ids[last:]])
    mask = np.concatenate([*out_mask, mask[last:]])
    mask[ids == pad_id] = 0
    return ids, mask


@dataclass(frozen=True)
class EncodedSample:
    """One conversation as tokens plus what its packed row needs to rebuild the pixels."""

    where: str
    """``"<file> row <n>"`` of the record."""
    input_ids: np.ndarray
    """int64 ``[L]``, vision pads expanded."""
    loss_mask: np.ndarray
    """uint8 ``[L]``: 1 on assistant-turn tokens (the targets)."""
    images: tuple[MediaRef, ...] = ()
    image_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    videos: tuple[MediaRef, ...] = ()
    video_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    video_frames: tuple[tuple[int, ...], ...] = ()
    """Indices of each video's kept frames."""
    second_per_grid: tuple[float, ...] = ()
    """Seconds covered by one temporal grid step of each video (M-RoPE)."""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class _VideoPlan:
    grid: tuple[int, int, int]
    frames: list[int]
    seconds_per_grid: float
    ids: list[int]
    """What stands for the video in the text (its pad tokens and any text around them)."""


class SampleEncoder:
    """Encodes :class:`Conversation` s with one tokenizer and processor.

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template and the vision tokens.
        processor: the vision processor whose grids decide the pad counts.
        video: how videos are sampled into frames.
        tokens: the vision tokens (default: Qwen's names looked up in ``tokenizer``).
    """

    def __init__(
        self,
        tokenizer: Any,
        processor: QwenVisionProcessor,
        *,
        video: VideoOptions | None = None,
        tokens: VisionTokens | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self.video = video or VideoOptions()
        self.tokens = tokens or VisionTokens.from_tokenizer(tokenizer)
        self._text_cache: dict[str, list[int]] = {}

    def _merged(self, grid: Sequence[int]) -> int:
        if hasattr(self.processor, "grid_tokens"):  # a processor with its own token rule
            return int(self.processor.grid_tokens(grid))
        return int(np.prod(grid)) // self.processor.config.merge_size**2

    def _text_ids(self, text: str) -> list[int]:
        if text not in self._text_cache:
            self._text_cache[text] = list(
                self.tokenizer(text, add_special_tokens=False)["input_ids"]
            )
        return self._text_cache[text]

    def _image_grid(self, ref: MediaRef, at: str, *, alone: bool = True) -> tuple[int, int, int]:
        width, height = load_image(ref, at).size
        if hasattr(self.processor, "image_grid"):  # e.g. LLaVA-OneVision: (views, h, w)
            return self.processor.image_grid(height, width, alone=alone)
        try:
            h, w = self.processor.image_size(height, width)
        except ValueError as exc:
            raise BadMediaError(at, ref.field, ref.describe(), str(exc)) from None
        p = self.processor.config.patch_size
        return 1, h // p, w // p

    def _video_plan(self, ref: MediaRef, at: str) -> _VideoPlan:
        if not getattr(self.processor, "takes_videos", True):
            raise DataError(f"{at}: {ref.field}: this model family takes images only, no videos")
        video = load_video(ref, at, self.video)
        try:
            keep = self.processor.sample_frames(
                len(video.frames),
                video_fps=video.fps,
                fps=self.video.fps,
                num_frames=self.video.num_frames,
            )
            height, width = video.frames[0].shape[:2]
            t, h, w = self.processor.video_grid(len(keep), height, width)
        except ValueError as exc:
            raise BadMediaError(at, ref.field, ref.describe(), str(exc)) from None
        sampled_fps = len(keep) / len(video.frames) * video.fps
        step = getattr(self.processor.config, "temporal_patch_size", 1)
        grid = (int(t), int(h), int(w))
        ids = self.processor.video_placeholder(grid, keep, video.fps, self.tokens, self._text_ids)
        return _VideoPlan(grid, keep, step / sampled_fps, ids)

    def encode(self, conv: Conversation) -> EncodedSample:
        """Tokens, mask and grids of ``conv``; bad media raise :class:`BadMediaError`."""
        at = conv.where
        alone = len(conv.images) == 1
        image_grids = [self._image_grid(ref, at, alone=alone) for ref in conv.images]
        plans = [self._video_plan(ref, at) for ref in conv.videos]
        ids, mask = render_conversation(self.tokenizer, conv.messages, self.tokens, at)
        t = self.tokens
        ids, mask = _expand(
            ids, mask, t.image_pad_id, [self._merged(g) for g in image_grids], "image", at
        )
        ids, mask = _splice(ids, mask, t.video_pad_id, [p.ids for p in plans], "video", at)
        return EncodedSample(
            where=at,
            input_ids=ids,
            loss_mask=mask,
            images=conv.images,
            image_grid_thw=np.asarray(image_grids, dtype=np.int64).reshape(-1, 3),
            videos=conv.videos,
            video_grid_thw=np.asarray([p.grid for p in plans], dtype=np.int64).reshape(-1, 3),
            video_frames=tuple(tuple(p.frames) for p in plans),
            second_per_grid=tuple(p.seconds_per_grid for p in plans),
        )

    def pixels(self, sample: EncodedSample) -> dict[str, torch.Tensor | None]:
        """``pixel_values`` / ``image_grid_thw`` / ``pixel_values_videos`` / ``video_grid_thw``
        of ``sample`` (``None`` where it has no image / video), checked against its grids."""
        out: dict[str, torch.Tensor | None] = dict.fromkeys(
            ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        )
        if sample.images:
            imgs = [load_image(ref, sample.where) for ref in sample.images]
            out.update(self.processor.preprocess_images(imgs))
        if sample.videos:
            clips = []
            for ref, keep in zip(sample.videos, sample.video_frames, strict=True):
                frames = load_video(ref, sample.where, self.video).frames
                if max(keep) >= len(frames):
                    raise BadMediaError(
                        sample.where, ref.field, ref.describe(), "changed since it was encoded"
                    )
                clips.append([frames[i] for i in keep])
            out.update(self.processor.preprocess_videos(clips))
        for key, want in (
            ("image_grid_thw", sample.image_grid_thw),
            ("video_grid_thw", sample.video_grid_thw),
        ):
            got = out[key]
            if got is not None and got.tolist() != want.tolist():
                raise DataError(
                    f"{sample.where}: {key} {got.tolist()} differs from the encoded "
                    f"{want.tolist()}: the media changed since encoding; encode the data again"
                )
        return out


@dataclass
class EncodingReport:
    """Counters of :func:`encode_conversations`."""

    records: int = 0
    samples: int = 0
    skipped_bad_media: int = 0
    truncated: int = 0
    dropped_overflow: int = 0
    dropped_no_assistant: int = 0
    bad: list[str] = field(default_factory=list)
    """The first few skipped samples' messages."""

    def as_dict(self) -> dict[str, int]:
        """The counters (without the messages)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}


def _kept(per_item: Sequence[int], tokens: int) -> int:
    """How many items (of ``per_item`` pad tokens each, in order) ``tokens`` pads hold."""
    return int(np.searchsorted(np.cumsum(per_item), tokens, side="right"))


def _truncate(sample: EncodedSample, max_len: int, encoder: SampleEncoder) -> EncodedSample:
    ids, t = sample.input_ids, encoder.tokens
    # Open vision blocks after each token (Qwen3-VL nests a video's frame blocks in one).
    depth = np.cumsum((ids == t.vision_start_id).astype(np.int64) - (ids == t.vision_end_id))
    if depth[max_len - 1] > 0:
        a = int(np.flatnonzero((ids[:max_len] == t.vision_start_id) & (depth[:max_len] == 1))[-1])
        b = a + int(np.argmax(depth[a:] == 0))
        raise SampleTooLongError(
            f"{sample.where}: {len(ids)} tokens do not fit in {max_len}, and cutting at "
            f"{max_len} would split the image/video tokens at [{a}, {b}]; raise seq_len, "
            "lower the processor's max_pixels, or use overflow='drop'"
        )
    kept = ids[:max_len]
    n_img = _kept(
        [encoder._merged(g) for g in sample.image_grid_thw], int((kept == t.image_pad_id).sum())
    )
    n_vid = _kept(
        [encoder.processor.video_tokens(g) for g in sample.video_grid_thw],
        int((kept == t.video_pad_id).sum()),
    )
    return EncodedSample(
        where=sample.where,
        input_ids=kept,
        loss_mask=sample.loss_mask[:max_len],
        images=sample.images[:n_img],
        image_grid_thw=sample.image_grid_thw[:n_img],
        videos=sample.videos[:n_vid],
        video_grid_thw=sample.video_grid_thw[:n_vid],
        video_frames=sample.video_frames[:n_vid],
        second_per_grid=sample.second_per_grid[:n_vid],
    )


def encode_conversations(
    conversations: Sequence[Conversation],
    encoder: SampleEncoder,
    *,
    max_len: int | None = None,
    overflow: Overflow = "error",
    skip_bad_samples: bool = False,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[EncodedSample], EncodingReport]:
    """Encode every conversation; returns the kept samples and the counters.

    ``max_len`` (the packed row length): a longer sample raises :class:`SampleTooLongError`
    naming its row (``overflow="error"``), is dropped and counted (``"drop"``), or keeps its
    first ``max_len`` tokens (``"truncate"``; refused when the cut would split an image's or
    video's tokens, media past the cut are dropped). Bad media raise, or with
    ``skip_bad_samples`` are skipped and counted. Samples without assistant tokens are
    dropped and counted.
    """
    if overflow not in ("error", "drop", "truncate"):
        raise ValueError(f"overflow={overflow!r} is not one of 'error', 'drop', 'truncate'")
    report = EncodingReport(records=len(conversations))
    out: list[EncodedSample] = []
    for i, conv in enumerate(conversations):
        if progress is not None:
            progress(i)
        try:
            sample = encoder.encode(conv)
        except BadMediaError as exc:
            if not skip_bad_samples:
                raise
            report.skipped_bad_media += 1
            if len(report.bad) < 10:
                report.bad.append(str(exc).split(". Fix")[0])
            continue
        if max_len is not None and len(sample) > max_len:
            if overflow == "error":
                t = encoder.tokens
                vision = int(np.isin(sample.input_ids, [t.image_pad_id, t.video_pad_id]).sum())
                raise SampleTooLongError(
                    f"{conv.where}: {len(sample)} tokens ({vision} of them image/video tokens) "
                    f"do not fit in seq_len={max_len}; raise seq_len, lower the processor's "
                    "max_pixels, or set overflow to 'drop' or 'truncate'"
                )
            if overflow == "drop":
                report.dropped_overflow += 1
                continue
            sample = _truncate(sample, max_len, encoder)
            report.truncated += 1
        if not sample.loss_mask.any():
            report.dropped_no_assistant += 1
            continue
        out.append(sample)
    report.samples = len(out)
    return out, report

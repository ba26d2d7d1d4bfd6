"""Packing encoded multimodal samples into rows of ``seq_len`` tokens for the VLM.

The plan is core's (``longboat.core.data.packing.plan_packing``, best-fit decreasing by
default): whole samples only — a sample longer than ``seq_len`` is refused
(:func:`~longboat.vlm.data.encoding.encode_conversations` drops, truncates or rejects
those first), so no image's tokens are ever split across rows. Text fields of a row come
from core's ``build_row``; the row then gets its M-RoPE position ids (restarting at every
sample) and its samples' pixels concatenated in token order.

One row (``PackedMultimodalDataset[i]``), ``S = seq_len``:

- ``input_ids`` int64 ``[1, S]``: the samples back to back, then ``pad_id``;
- ``labels`` int64 ``[1, S]``: ``labels[0, i]`` is the token predicted at position ``i``,
  i.e. ``input_ids[0, i + 1]`` of the same sample, where that token is an assistant
  target; ``-100`` elsewhere (last token of a sample, non-assistant targets, padding) —
  megatron ``GPTModel``'s convention, as in the llm stack (clamp ``-100`` to 0 before the
  model; ``loss_mask`` carries the zeros);
- ``loss_mask`` float32 ``[1, S]``: 1 where ``labels`` counts;
- ``position_ids`` int64 ``[3, 1, S]``: M-RoPE (t, h, w) positions, each sample from 0,
  padding counted as one more text segment (``positions="mrope_frames"``, Qwen3-VL: each
  frame group of a video placed like a one-frame image; ``"1d"``: ``[1, S]``, one stream);
- ``cu_seqlens`` int32 ``[k + 1]``: sample boundaries, padding as the last segment, so
  ``cu_seqlens[-1] == S``; ``max_seqlen``: the longest segment;
- ``pixel_values`` float32 ``[N, C*T*p*p]`` and ``image_grid_thw`` int64 ``[n, 3]``: the
  row's images in token order (``None`` when it has none); likewise
  ``pixel_values_videos`` / ``video_grid_thw`` and ``second_per_grid_ts`` float32 ``[m]``;
- ``sample_index``: the packed samples' indices (into the dataset's sample list).

:class:`PackedRowStream` walks the rows in a seeded order (core's
``StatefulDistributedSampler``: the same order on every rank and restart, sharded by DP
rank) and resumes mid-epoch from ``state_dict()``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from longboat.core.data.packing import (
    IGNORE_INDEX,
    Strategy,
    build_row,
    plan_packing,
    plan_unpacked,
)
from longboat.core.data.sampler import StatefulDistributedSampler
from longboat.vlm.data.encoding import EncodedSample, SampleEncoder
from longboat.vlm.data.errors import DataError, SampleTooLongError
from longboat.vlm.models.mrope import mrope_position_ids

__all__ = ["POSITION_KINDS", "PackedMultimodalDataset", "PackedRowStream", "sample_position_ids"]

POSITION_KINDS = ("mrope", "mrope_frames", "1d")
"""Position ids of packed rows: Qwen2-VL's M-RoPE, Qwen3-VL's (frame groups as runs), 1D."""


class _Documents:
    """The samples as core packing's documents (``input_ids`` + target ``loss_mask``)."""

    def __init__(self, samples: Sequence[EncodedSample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        s = self.samples[i]
        return {"input_ids": s.input_ids, "loss_mask": s.loss_mask}

    def lengths(self) -> np.ndarray:
        return np.asarray([len(s) for s in self.samples], dtype=np.int64)


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    kept = [p for p in parts if p is not None]
    return torch.cat(kept) if kept else None


def sample_position_ids(
    sample: EncodedSample, encoder: SampleEncoder, *, tokens_per_second: float
) -> torch.Tensor:
    """``[3, 1, L]`` M-RoPE position ids of one sample on its own (Qwen3-VL's frame groups
    when the encoder's processor says ``position_kind = "mrope_frames"``)."""
    t = encoder.tokens
    kind = getattr(encoder.processor, "position_kind", "mrope")
    return mrope_position_ids(
        torch.from_numpy(sample.input_ids)[None],
        image_token_id=t.image_pad_id,
        video_token_id=t.video_pad_id,
        spatial_merge_size=encoder.processor.config.merge_size,
        tokens_per_second=tokens_per_second,
        image_grid_thw=torch.from_numpy(sample.image_grid_thw),
        video_grid_thw=torch.from_numpy(sample.video_grid_thw),
        seconds_per_grid=list(sample.second_per_grid),
        frames_as_runs=kind == "mrope_frames",
    )


class PackedMultimodalDataset(torch.utils.data.Dataset):
    """Rows of ``seq_len`` tokens packed from encoded samples (keys in the module doc).

    Args:
        samples: encoded samples, each at most ``seq_len`` tokens.
        encoder: the encoder that made them (its processor rebuilds the pixels).
        seq_len: tokens per row.
        pad_id: token id of padding (never a label; not a vision token).
        tokens_per_second: the model's temporal M-RoPE step per second of video.
        positions: ``mrope`` (Qwen2-VL's three streams), ``mrope_frames`` (Qwen3-VL's: a
            video's frame groups placed as one-frame images) or ``1d`` (one stream per
            sample); default: the encoder's processor's ``position_kind``.
        strategy: ``best_fit`` or ``greedy`` (core's ``plan_packing``).
        packed: ``False`` puts one sample per row (padded), for comparisons.
        ignore_index: label value of positions without a target.
    """

    def __init__(
        self,
        samples: Sequence[EncodedSample],
        encoder: SampleEncoder,
        *,
        seq_len: int,
        pad_id: int,
        tokens_per_second: float,
        positions: str | None = None,
        strategy: Strategy = "best_fit",
        packed: bool = True,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        if not samples:
            raise DataError("no samples to pack: every record was skipped or dropped")
        t = encoder.tokens
        if pad_id in (t.image_pad_id, t.video_pad_id):
            raise ValueError(f"pad_id={pad_id} is a vision pad token; use the tokenizer's pad")
        for s in samples:
            if len(s) > seq_len:
                raise SampleTooLongError(
                    f"{s.where}: {len(s)} tokens do not fit in seq_len={seq_len}; encode with "
                    "max_len=seq_len (encode_conversations) to drop or truncate such samples"
                )
        self.samples = samples
        self.encoder = encoder
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.tokens_per_second = tokens_per_second
        if positions is None:
            positions = getattr(encoder.processor, "position_kind", "mrope")
        if positions not in POSITION_KINDS:
            raise ValueError(f"positions={positions!r} is not one of {POSITION_KINDS}")
        self.positions = positions
        self.ignore_index = ignore_index
        self._docs = _Documents(samples)
        lengths = self._docs.lengths()
        self.rows = (
            plan_packing(lengths, seq_len, strategy=strategy)
            if packed
            else plan_unpacked(lengths, seq_len)
        )
        self.num_tokens = int(lengths.sum())

    @property
    def fill(self) -> float:
        """Fraction of row slots holding tokens (1.0 = no padding)."""
        return self.num_tokens / (len(self.rows) * self.seq_len)

    def plan_fingerprint(self) -> str:
        """sha256 (16 hex digits) of the plan: which samples sit in which row."""
        plan = [[(p.doc, p.start, p.stop) for p in row] for row in self.rows]
        return hashlib.sha256(json.dumps([self.seq_len, plan]).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        pieces = self.rows[index]
        row = build_row(
            pieces, self._docs, self.seq_len, pad_id=self.pad_id, ignore_index=self.ignore_index
        )
        members = [self.samples[p.doc] for p in pieces]
        media = [self.encoder.pixels(s) for s in members]
        image_grid = _cat([m["image_grid_thw"] for m in media])
        video_grid = _cat([m["video_grid_thw"] for m in media])
        seconds = [x for s in members for x in s.second_per_grid]
        input_ids = torch.from_numpy(row["input_ids"])[None]
        cu = row["cu_seqlens"]
        t = self.encoder.tokens
        if self.positions == "1d":
            bounds = torch.from_numpy(cu).long()
            idx = torch.arange(self.seq_len)
            starts = bounds[torch.bucketize(idx, bounds[1:], right=True)]
            position_ids = (idx - starts)[None]
        else:
            position_ids = mrope_position_ids(
                input_ids,
                image_token_id=t.image_pad_id,
                video_token_id=t.video_pad_id,
                spatial_merge_size=self.encoder.processor.config.merge_size,
                tokens_per_second=self.tokens_per_second,
                image_grid_thw=image_grid,
                video_grid_thw=video_grid,
                seconds_per_grid=seconds,
                cu_seqlens=cu.tolist(),
                frames_as_runs=self.positions == "mrope_frames",
            )
        return {
            "input_ids": input_ids,
            "labels": torch.from_numpy(row["labels"])[None],
            "loss_mask": torch.from_numpy(row["loss_mask"])[None],
            "position_ids": position_ids,
            "cu_seqlens": torch.from_numpy(cu),
            "max_seqlen": int(np.diff(cu).max()),
            "pixel_values": _cat([m["pixel_values"] for m in media]),
            "image_grid_thw": image_grid,
            "pixel_values_videos": _cat([m["pixel_values_videos"] for m in media]),
            "video_grid_thw": video_grid,
            "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32) if seconds else None,
            "sample_index": [p.doc for p in pieces],
        }


class PackedRowStream:
    """The rows of ``dataset`` in a seeded, per-epoch order; sharded by DP rank; resumable.

    Iterating yields this rank's rows from the saved position to the end of the epoch; the
    next pass is the next epoch (a fresh permutation of ``seed + epoch``). ``state_dict()``
    is the global position in the epoch plus what the order depends on.
    """

    def __init__(
        self,
        dataset: PackedMultimodalDataset,
        *,
        seed: int,
        shuffle: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        self.dataset = dataset
        self.sampler = StatefulDistributedSampler(
            len(dataset),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for index in self.sampler:
            yield self.dataset[index]

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's epoch and position and the packing plan's fingerprint."""
        return {"sampler": self.sampler.state_dict(), "plan": self.dataset.plan_fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was saved (same samples, ``seq_len`` and seed)."""
        mine = self.dataset.plan_fingerprint()
        if state["plan"] != mine:
            raise DataError(
                f"data state is for packing plan {state['plan']}, this data packs as {mine}: "
                "resume with the same data files, tokenizer, processor settings and seq_len"
            )
        self.sampler.load_state_dict(state["sampler"])

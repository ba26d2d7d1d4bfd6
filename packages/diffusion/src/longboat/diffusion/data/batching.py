"""Micro-batches of latent samples: bucketed by shape or packed by a token budget; collation.

:class:`LatentBatchSampler` yields lists of sample indices, deterministic and resumable:

- ``bucket``: samples of one latent shape per batch (no padding). For epoch ``e`` every shape's
  samples are permuted with the seed ``(seed, e, bucket)`` and cut into batches;
- ``pack``: samples of any shapes per batch, up to ``max_tokens`` model tokens (best-fit
  decreasing through core's :func:`~longboat.core.data.packing.plan_packing`; the plan does
  not change between epochs).

The order of the batches is core's
:class:`~longboat.core.data.sampler.StatefulDistributedSampler` over batch numbers (a fresh
permutation of ``seed + e`` each epoch, rank ``r`` of ``W`` taking batches ``r, r + W, ...``),
so the saved position is global and a run resumes exactly, at any world size.

:func:`collate_latents` turns samples into the model's inputs (see its doc).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from longboat.core.data.packing import plan_packing
from longboat.core.data.sampler import StatefulDistributedSampler
from longboat.diffusion.data.errors import DataError

__all__ = ["LatentBatchSampler", "collate_latents"]


class LatentBatchSampler(Sampler[list[int]]):
    """Batches of sample indices for one data-parallel rank (see the module doc).

    Args:
        shapes: ``[N, 3]`` latent ``(T, H, W)`` of every sample (``LatentDataset.shapes``).
        batch_size: samples per batch (``bucket``; the last batch of a shape may be smaller
            unless ``drop_last``).
        mode: ``bucket`` or ``pack``.
        max_tokens: ``pack``: model tokens per batch.
        patch_size: the model's ``(t, h, w)`` patch, to count tokens.
        shuffle: shuffle samples inside shapes and the order of batches every epoch.
        seed: seed of both orders.
        drop_last: ``bucket``: drop every shape's incomplete last batch.
        num_replicas / rank: data-parallel size and rank (default: the process group's).
    """

    def __init__(
        self,
        shapes: np.ndarray | Sequence[Sequence[int]],
        *,
        batch_size: int = 1,
        mode: str = "bucket",
        max_tokens: int | None = None,
        patch_size: Sequence[int] = (1, 2, 2),
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.shapes = np.asarray(shapes, dtype=np.int64).reshape(-1, 3)
        if len(self.shapes) == 0:
            raise ValueError("LatentBatchSampler got no samples")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.batch_size, self.mode, self.max_tokens = batch_size, mode, max_tokens
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        p = np.asarray(patch_size, dtype=np.int64)
        self.tokens = np.prod(-(-self.shapes // p), axis=1)
        if mode == "bucket":
            keys = sorted({tuple(s) for s in self.shapes.tolist()})
            self._buckets = [
                np.flatnonzero((self.shapes == np.asarray(k)).all(axis=1)) for k in keys
            ]
            per = [
                len(b) // batch_size if drop_last else -(-len(b) // batch_size)
                for b in self._buckets
            ]
            num_batches = sum(per)
            if num_batches == 0:
                raise DataError(
                    f"no shape has {batch_size} samples, so drop_last leaves no batch; lower "
                    "the micro-batch size or set drop_last=false"
                )
            self._packs: list[list[int]] | None = None
        elif mode == "pack":
            if max_tokens is None or max_tokens < 1:
                raise ValueError(f"mode='pack' needs max_tokens >= 1, got {max_tokens}")
            too_long = np.flatnonzero(self.tokens > max_tokens)
            if len(too_long):
                i = int(too_long[0])
                raise DataError(
                    f"sample {i} (latents {tuple(self.shapes[i].tolist())}) is "
                    f"{int(self.tokens[i])} tokens, more than max_tokens={max_tokens} "
                    f"({len(too_long)} such samples): raise max_tokens to at least "
                    f"{int(self.tokens.max())}"
                )
            rows = plan_packing(self.tokens.tolist(), max_tokens, strategy="best_fit")
            self._packs = [[p.doc for p in row] for row in rows]
            num_batches = len(self._packs)
        else:
            raise ValueError(f"mode={mode!r} is not one of 'bucket', 'pack'")
        self.num_batches = num_batches
        self._order = StatefulDistributedSampler(
            num_batches, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
        )

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Every batch of ``epoch`` (sample indices), by batch number: the order the batches
        are drawn in is apart from this (core's sampler here, the global batch plan in
        training)."""
        if self._packs is not None:
            return self._packs
        batches: list[list[int]] = []
        for b, members in enumerate(self._buckets):
            if self.shuffle:
                members = members[
                    np.random.default_rng([self.seed, epoch, b]).permutation(len(members))
                ]
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                if len(chunk) == self.batch_size or not self.drop_last:
                    batches.append([int(i) for i in chunk])
        return batches

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._order.epoch

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its start (the current epoch keeps its position)."""
        self._order.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        order = iter(self._order)  # advances the epoch after a finished pass
        plan = self.epoch_batches(self._order.epoch)
        return (plan[b] for b in order)

    def __len__(self) -> int:
        """Batches this rank yields in the next pass."""
        return len(self._order)

    def state_dict(self) -> dict[str, Any]:
        """Epoch, global batch position and what the batches depend on."""
        return {
            "order": self._order.state_dict(),
            "mode": self.mode,
            "batch_size": self.batch_size,
            "max_tokens": self.max_tokens,
            "drop_last": self.drop_last,
            "num_samples": len(self.shapes),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume where ``state`` was saved (same data and batching; any world size)."""
        mine = self.state_dict()
        for key in ("mode", "batch_size", "max_tokens", "drop_last", "num_samples"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"batch-sampler state has {key}={state[key]!r}, this sampler has "
                    f"{key}={mine[key]!r}: resume with the same data and batching settings"
                )
        self._order.load_state_dict(dict(state["order"]))


def collate_latents(
    samples: Sequence[Mapping[str, Any]],
    *,
    packed: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Samples of :class:`~longboat.diffusion.data.dataset.LatentDataset` -> model inputs.

    - ``latents``: ``[B, C, T, H, W]`` (zero-padded to the largest ``T, H, W`` of the batch), or
      with ``packed`` a list of ``[C, T_i, H_i, W_i]``;
    - ``latent_mask``: ``[B, T, H, W]`` bool, True on real positions (padded only);
    - ``latent_shapes``: ``[B, 3]`` int64, each sample's ``(T, H, W)``;
    - ``text_embeds``: ``[B, L, D]`` zero-padded to the longest caption, ``text_mask``
      ``[B, L]`` bool, ``text_lengths`` ``[B]``;
    - ``captions`` (list of str), ``metadata`` (list of dict), ``indices`` ``[B]`` int64.
    """
    if not samples:
        raise ValueError("collate_latents got no samples")
    lat = [s["latents"].to(dtype) for s in samples]
    txt = [s["text_embeds"].to(dtype) for s in samples]
    shapes = torch.tensor([list(x.shape[1:]) for x in lat], dtype=torch.int64)
    lengths = torch.tensor([t.shape[0] for t in txt], dtype=torch.int64)
    b, d = len(samples), txt[0].shape[1]
    text = torch.zeros(b, int(lengths.max()), d, dtype=dtype)
    text_mask = torch.zeros(b, int(lengths.max()), dtype=torch.bool)
    for i, t in enumerate(txt):
        text[i, : t.shape[0]] = t
        text_mask[i, : t.shape[0]] = True
    out: dict[str, Any] = {
        "latent_shapes": shapes,
        "text_embeds": text,
        "text_mask": text_mask,
        "text_lengths": lengths,
        "captions": [str(s.get("caption", "")) for s in samples],
        "metadata": [dict(s.get("metadata", {})) for s in samples],
        "indices": torch.tensor([int(s.get("index", -1)) for s in samples], dtype=torch.int64),
    }
    if all("pooled_embeds" in s for s in samples):
        out["pooled_embeds"] = torch.stack([s["pooled_embeds"].to(dtype) for s in samples])
    if packed:
        out["latents"] = lat
        return out
    tm, hm, wm = (int(v) for v in shapes.max(dim=0).values)
    latents = torch.zeros(b, lat[0].shape[0], tm, hm, wm, dtype=dtype)
    mask = torch.zeros(b, tm, hm, wm, dtype=torch.bool)
    for i, x in enumerate(lat):
        t, h, w = x.shape[1:]
        latents[i, :, :t, :h, :w] = x
        mask[i, :t, :h, :w] = True
    out["latents"] = latents
    out["latent_mask"] = mask
    return out

"""Caption dropout for classifier-free guidance (``data.caption_dropout``).

Each sample of a training micro-batch keeps its caption with probability ``1 - p``; the
others get the dataset's empty-caption embedding (``empty_caption.safetensors``) and a text
mask of its length. The draws come from a generator seeded by ``(seed, tag, step, position)``, apart
from the noise's, so a resumed run drops the same captions and the noise of a step does not
depend on ``p``.
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.diffusion.train.data import noise_seed

__all__ = ["CaptionDropout"]

_TAG = 0xCA_D0
"""Tag of the dropout draws' seeds."""


class CaptionDropout:
    """Replaces a share ``p`` of a batch's captions with the empty caption (module doc)."""

    def __init__(
        self, p: float, empty: torch.Tensor, seed: int, empty_pooled: torch.Tensor | None = None
    ) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"caption dropout {p} must be in [0, 1)")
        self.p, self.empty, self.seed = float(p), empty.float(), int(seed)
        self.empty_pooled = None if empty_pooled is None else empty_pooled.float()
        """The empty caption's pooled embedding, for batches that carry ``pooled_embeds``."""

    def dropped(self, n: int, step: int, position: int) -> torch.Tensor:
        """``[n]`` bool: which of a micro-batch's ``n`` samples lose their caption."""
        gen = torch.Generator().manual_seed(noise_seed(self.seed, _TAG, step, position))
        return torch.rand(n, generator=gen) < self.p

    def apply(self, batch: dict[str, Any], step: int, position: int) -> dict[str, Any]:
        """``batch`` (host, collated) with the dropped samples' ``text_embeds`` /
        ``text_mask`` rows replaced (padded to the empty caption's length when it is the
        longer); the same dict when none is dropped."""
        text, mask = batch["text_embeds"], batch["text_mask"]
        drop = self.dropped(text.shape[0], step, position)
        if not bool(drop.any()):
            return batch
        n, length, dim = text.shape
        empty = self.empty.to(text.dtype)
        width = max(length, empty.shape[0])
        new_text = text.new_zeros(n, width, dim)
        new_text[:, :length] = text
        new_mask = mask.new_zeros(n, width)
        new_mask[:, :length] = mask
        rows = drop.nonzero().flatten()
        new_text[rows] = 0
        new_text[rows, : empty.shape[0]] = empty
        new_mask[rows] = 0
        new_mask[rows, : empty.shape[0]] = 1
        out = {**batch, "text_embeds": new_text, "text_mask": new_mask}
        pooled = batch.get("pooled_embeds")
        if pooled is not None:
            if self.empty_pooled is None:
                raise ValueError("the batch carries pooled_embeds but the empty caption has none")
            pooled = pooled.clone()
            pooled[rows] = self.empty_pooled.to(pooled.dtype)
            out["pooled_embeds"] = pooled
        return out

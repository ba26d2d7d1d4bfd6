"""The cost of a packed row, for data-parallel load balancing (``vlm.dp_balance``).

Every step takes the same global batch of packed rows (core's global batch plan,
``data.row_plan``); with the costs here the plan deals them to the ranks by cost (core's
:func:`~longboat.core.data.balance.balance`, each rank getting its ``global_batch / DP``
microbatches) instead of rank ``r`` taking rows ``r, r + DP, ...``. The global batch, and so
the step's loss (the mean over every target token of it), stays the same; only who computes
which row changes. The assignment is a pure function of the step, so resume is exact.

A row's cost is its decoder cost plus its vision tower's (:func:`cost_models`, from the
model's shapes, in FLOPs): attention is quadratic in each packed sample's length (a row of
one 8k-token sample costs more than a row of sixteen 512-token ones), and the ViT's full
attention is quadratic in each image's (each video frame's) patches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from longboat.core.data.balance import CostModel

__all__ = ["cost_models", "row_costs"]


def cost_models(model_cfg: Any) -> tuple[CostModel, CostModel]:
    """(decoder, vision) training FLOPs: forward + backward, attention per token pair
    (causal in the decoder), linears per token."""
    lang, vis = model_cfg.language, model_cfg.vision
    h, layers = lang.hidden_size, lang.num_layers
    heads = lang.num_attention_heads
    head_dim = getattr(lang, "head_dim", None) or h // heads
    kv = getattr(lang, "num_query_groups", None) or heads
    per_layer = h * head_dim * (2 * heads + 2 * kv) + 3 * h * lang.ffn_hidden_size
    decoder = CostModel(quadratic=6.0 * heads * head_dim * layers, linear=6.0 * per_layer * layers)
    vh = vis.hidden_size
    depth = getattr(vis, "depth", None) or getattr(vis, "num_layers", 0)
    ffn = getattr(vis, "intermediate_size", None) or 4 * vh
    vision = CostModel(
        quadratic=12.0 * vh * depth, linear=6.0 * (4 * vh * vh + 2 * vh * ffn) * depth
    )
    return decoder, vision


def _vision_units(model_cfg: Any, grid: Sequence[int]) -> list[int]:
    """Patches per attention unit of one image / video: each frame group of a Qwen-VL grid
    ``(t, h, w)`` attends within its ``h * w`` patches; a SigLIP tower (LLaVA-style grids
    ``(views, height, width)``) within each view's square of patches."""
    vis = model_cfg.vision
    if hasattr(vis, "image_size"):
        side = vis.image_size // vis.patch_size
        return [side * side] * int(grid[0])
    t, h, w = (int(x) for x in grid)
    return [h * w] * t


def row_costs(dataset: Any, model_cfg: Any) -> np.ndarray:
    """The cost of every packed row of ``dataset`` (a ``PackedMultimodalDataset``)."""
    decoder, vision = cost_models(model_cfg)
    out = np.empty(len(dataset.rows))
    for i, pieces in enumerate(dataset.rows):
        cost = decoder.cost([p.length for p in pieces])
        # The padding segment runs through the linears too (attention over it is masked).
        cost += decoder.linear * (dataset.seq_len - sum(p.length for p in pieces))
        for p in pieces:
            s = dataset.samples[p.doc]
            for grid in (*s.image_grid_thw, *s.video_grid_thw):
                cost += vision.cost(_vision_units(model_cfg, grid))
        out[i] = cost
    return out

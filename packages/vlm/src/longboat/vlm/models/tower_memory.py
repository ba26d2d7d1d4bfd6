"""The vision towers' shapes as the megatron memory plan reads them (core's
``megatron.engine.memory_shapes.EncoderShapes``): the blocks from the tower's widths, the
parts around them (patch and position embedding, mergers) counted here per family.

A family module exposes ``tower_shapes(vision_cfg, *, tokens, weight_bytes,
tensor_parallel)``; a family without one runs unplanned (its run says so). ``tokens`` is read
from the rows' ``image_grid_thw`` / ``video_grid_thw`` as the Qwen families lay them out
(frames, rows, columns of patches); LLaVA-OneVision's grids (views and pixel sizes) mean
something else, and its SigLIP tower has no estimate yet.
"""

from __future__ import annotations

from typing import Any

from longboat.core.megatron.engine.memory_shapes import EncoderShapes


def _merger(width: int, out: int, tp: int, *, norm: int) -> int:
    """Parameters of a merger: its norm (``norm`` parameters), Linear -> GELU -> Linear
    (biases; fc1 column-, fc2 row-parallel)."""
    return norm + width * width // tp + width // tp + width // tp * out + out


def _merger_saved(tokens: int, hidden: int, e: int, *, stats: int, rows: int) -> int:
    """Bytes a merger saves at ``tokens`` patches: the norm's input and statistics (over
    ``rows`` rows), fc1's input, GELU's input and fc2's input (``tokens x hidden`` each)."""
    return 4 * e * tokens * hidden + stats * rows


def qwen2_5_tower_shapes(
    cfg: Any, *, tokens: int, weight_bytes: int, tensor_parallel: int = 1
) -> EncoderShapes:
    """The Qwen2.5-VL ViT (RMSNorm, SwiGLU blocks; a bias-free patch embedding; the RMSNorm
    merger) at ``tokens`` patches a row."""
    h, mu, tp, e = cfg.hidden_size, cfg.merge_unit, tensor_parallel, weight_bytes
    other = cfg.patch_dim * h + _merger(h * mu, cfg.out_hidden_size, tp, norm=h)
    # the merger, the permutations into and out of window order (int64)
    saved = _merger_saved(tokens, h, e, stats=4, rows=tokens) + 8 * tokens + 8 * tokens // mu
    return EncoderShapes(
        hidden=h, ffn=cfg.intermediate_size, layers=cfg.depth, heads=cfg.num_heads,
        head_dim=cfg.head_dim, tokens=tokens, gated=True, layer_norm=False,
        tensor_parallel=tp, weight_bytes=e, other_params=other, other_saved=saved,
    )  # fmt: skip


def qwen3_tower_shapes(
    cfg: Any, *, tokens: int, weight_bytes: int, tensor_parallel: int = 1
) -> EncoderShapes:
    """The Qwen3-VL ViT (LayerNorm, GELU blocks; a patch embedding with a bias and the
    learned position table; the LayerNorm merger and one deepstack merger per listed block)
    at ``tokens`` patches a row."""
    h, mu, tp, e = cfg.hidden_size, cfg.merge_unit, tensor_parallel, weight_bytes
    deep = len(cfg.deepstack_visual_indexes)
    other = cfg.patch_dim * h + h + cfg.num_position_embeddings * h
    other += _merger(h * mu, cfg.out_hidden_size, tp, norm=2 * h)
    other += deep * _merger(h * mu, cfg.out_hidden_size, tp, norm=2 * h * mu)
    saved = _merger_saved(tokens, h, e, stats=8, rows=tokens)
    saved += deep * _merger_saved(tokens, h, e, stats=8, rows=tokens // mu)
    return EncoderShapes(
        hidden=h, ffn=cfg.intermediate_size, layers=cfg.depth, heads=cfg.num_heads,
        head_dim=cfg.head_dim, tokens=tokens, gated=False, layer_norm=True,
        tensor_parallel=tp, weight_bytes=e, other_params=other, other_saved=saved,
    )  # fmt: skip


__all__ = ["qwen2_5_tower_shapes", "qwen3_tower_shapes"]

"""Training FLOPs of one Wan sample (for MFU): pure arithmetic on the config."""

from __future__ import annotations

import math
from typing import Any


def flops_per_sample(cfg: Any, tokens: int, text_len: int) -> float:
    """Training FLOPs (3x the forward) of one sample of ``tokens`` video tokens and
    ``text_len`` caption tokens (``cfg``: a ``WanConfig``). Forward, ``d`` = heads x head dim,
    ``f`` = FFN width, per block: self-attention projections 8 d^2 and FFN 4 d f per token,
    cross-attention q / out 4 d^2 per token and k / v 4 d^2 per caption token; attention
    4 s d per token (QK^T and AV over all ``s`` video tokens, no mask) and 4 L d per token over
    the caption. Outside the blocks: the patch embedding and output projection 2 d (C p) each
    per token, the text embedder 2 L (D_text d + d^2), the time embedder and its projection
    2 (freq d + d^2 + 6 d^2). Elementwise work (norms, modulation, RoPE, GELU) is not counted."""
    d = cfg.num_attention_heads * cfg.attention_head_dim
    f, s, n, L = cfg.ffn_dim, tokens, cfg.num_layers, text_len
    patch = math.prod(cfg.patch_size)
    block = s * (12 * d * d + 4 * d * f) + 4 * L * d * d + 4 * s * s * d + 4 * s * L * d
    outside = 2 * s * d * patch * (cfg.in_channels + cfg.out_channels)
    outside += 2 * L * (cfg.text_dim * d + d * d) + 2 * (cfg.freq_dim * d + 7 * d * d)
    return 3.0 * (n * block + outside)

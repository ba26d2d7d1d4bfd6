"""Training FLOPs of one Qwen2.5-VL sample (for MFU): pure arithmetic on the config."""

from __future__ import annotations

from typing import Any


def flops_per_sample(cfg: Any, tokens: int, grids: list[list[int]]) -> float:
    """Training FLOPs (x3 of the forward) of one sample of ``tokens`` decoder tokens whose
    images / videos have patch grids ``grids`` (``[t, h, w]`` each): decoder 2 N per token
    (N: every layer's matrices), the LM head 2 h V per token, causal attention 2 s d per
    token per layer; ViT 2 N per patch plus attention 4 s d per token per layer over windows
    of ``(window / patch)^2`` patches, or the whole frame in the full-attention layers."""
    m, v = cfg.language, cfg.vision
    h, hd = m.hidden_size, m.head_dim
    layer = h * hd * (2 * m.num_attention_heads + 2 * m.num_query_groups)
    layer += 3 * h * m.ffn_hidden_size
    fwd = tokens * (2 * layer * m.num_layers + 2 * h * m.vocab_size)
    fwd += 2 * tokens * tokens * m.num_attention_heads * hd * m.num_layers
    vh = v.hidden_size
    vlayer = 4 * vh * vh + 3 * vh * v.intermediate_size
    window = (v.window_size // v.patch_size) ** 2
    full = len(v.fullatt_block_indexes)
    for t, gh, gw in grids:
        patches = t * gh * gw
        fwd += 2 * patches * vlayer * v.depth
        fwd += 4 * vh * t * (gh * gw) ** 2 * full
        fwd += 4 * vh * patches * min(window, gh * gw) * (v.depth - full)
    return 3.0 * fwd

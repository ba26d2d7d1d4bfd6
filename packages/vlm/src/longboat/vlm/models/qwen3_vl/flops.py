"""Training FLOPs of one Qwen3-VL or Qwen3-VL-MoE sample (for MFU): pure arithmetic on the
config. An MoE decoder counts the parameters a token passes through (its router and its
top-k experts), not every expert."""

from __future__ import annotations

from typing import Any


def decoder_layer_active_params(lang: Any) -> int:
    """Matrix parameters one token passes through in one decoder layer: the attention
    projections and either the dense SwiGLU or the router plus ``moe_topk`` expert SwiGLUs."""
    h, hd = lang.hidden_size, lang.head_dim
    n = h * hd * (2 * lang.num_attention_heads + 2 * lang.num_query_groups)
    if lang.num_experts:
        return n + h * lang.num_experts + lang.moe_topk * 3 * h * lang.moe_ffn_hidden_size
    return n + 3 * h * lang.ffn_hidden_size


def vision_forward_flops(v: Any, grids: list[list[int]]) -> float:
    """Forward FLOPs of the tower over patch grids ``grids`` (``[t, h, w]`` each): the patch
    embedding and 2 N per patch of each block's matrices, full attention within each frame
    (4 s d per patch per block), the patch merger and each deepstack merger per merged token."""
    vh, mu = v.hidden_size, v.merge_unit
    block = 4 * vh * vh + 2 * vh * v.intermediate_size
    merger = (vh * mu) * (vh * mu) + (vh * mu) * v.out_hidden_size
    mergers = 1 + len(v.deepstack_visual_indexes)
    fwd = 0.0
    for t, gh, gw in grids:
        patches = t * gh * gw
        fwd += 2 * patches * (v.patch_dim * vh + block * v.depth)
        fwd += 4 * vh * t * (gh * gw) ** 2 * v.depth
        fwd += 2 * (patches // mu) * merger * mergers
    return fwd


def flops_per_sample(cfg: Any, tokens: int, grids: list[list[int]]) -> float:
    """Training FLOPs (x3 of the forward) of one sample of ``tokens`` decoder tokens whose
    images / videos have patch grids ``grids``: decoder 2 N per token (N: each layer's
    active matrices, ``decoder_layer_active_params``), the LM head 2 h V per token, causal
    attention 2 s d per token per layer; the tower as ``vision_forward_flops``."""
    m = cfg.language
    fwd = tokens * (
        2 * decoder_layer_active_params(m) * m.num_layers + 2 * m.hidden_size * m.vocab_size
    )
    fwd += 2 * tokens * tokens * m.num_attention_heads * m.head_dim * m.num_layers
    fwd += vision_forward_flops(cfg.vision, grids)
    return 3.0 * fwd

"""Useful training FLOPs of one GR00T N1.6 sample (the benchmarks' MFU)."""

from __future__ import annotations

from typing import Any


def flops_per_sample(cfg: Any, num_cameras: int, image_hw: tuple[int, int], text_len: int) -> float:
    """Matmuls + attention of one sample of ``num_cameras`` frames of ``image_hw`` and
    ``text_len`` text tokens: forward, and backward where gradients flow (the top LM layers
    and the action head)."""
    v, lm, dit = cfg.vision, cfg.llm, cfg.dit
    oh, ow = cfg.image.output_size(*image_hw)
    t_img = (oh // v.patch_size) * (ow // v.patch_size)
    d = v.hidden_size
    vit_layer = 2 * t_img * (4 * d * d + 2 * d * v.intermediate_size) + 4 * t_img * t_img * d
    vit = num_cameras * v.num_layers * vit_layer
    t_tok = t_img // cfg.pixel_unshuffle**2
    proj = num_cameras * 2 * t_tok * (4 * d * lm.hidden_size + lm.hidden_size**2)
    seq, h = num_cameras * t_tok + text_len, lm.hidden_size
    attn_w = h * lm.num_heads * lm.head_dim * 2 + h * lm.num_kv_heads * lm.head_dim * 2
    lm_layer = (
        2 * seq * (attn_w + 3 * h * lm.intermediate_size)
        + 4 * seq * seq * lm.num_heads * lm.head_dim
    )
    lm_fwd, lm_bwd = cfg.select_layer * lm_layer, 2 * cfg.tune_top_llm_layers * lm_layer
    inner, t = dit.inner_dim, cfg.action_horizon + 1
    dit_fwd = 0.0
    for i in range(dit.num_layers):
        ctx = seq if i % 2 == 0 else t
        kv_in = dit.cross_attention_dim if i % 2 == 0 else inner
        dit_fwd += 2 * t * 2 * inner * inner + 2 * ctx * 2 * kv_in * inner
        dit_fwd += 4 * t * ctx * inner + 2 * t * 2 * inner * dit.ff_mult * inner
    a = cfg.max_action_dim
    enc = 2 * cfg.action_horizon * (a * inner + 2 * inner * inner + inner * inner)
    dec = 2 * t * (dit.output_dim * cfg.action_decoder_hidden + cfg.action_decoder_hidden * a)
    return float(vit + proj + lm_fwd + lm_bwd + 3 * (dit_fwd + enc + dec))

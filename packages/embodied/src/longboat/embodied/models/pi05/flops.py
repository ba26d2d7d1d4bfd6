"""Useful training FLOPs of one pi0.5 sample (the benchmarks' MFU)."""

from __future__ import annotations

from typing import Any


def flops_per_sample(
    cfg: Any, num_cameras: int | None = None, image_hw: Any = None, text_len: int = 0
) -> float:
    """fwd + bwd = 3x fwd (everything trains): the ViT on every camera slot (the config's
    ``num_cameras``, frames padded to ``image.pad_to_square``: ``num_cameras`` and
    ``image_hw`` are not used), the projector, the joint LM + expert layers over longboat's
    prefix (images + ``text_len`` text + state tokens) and the action suffix; not counted:
    the last LM layer's prefix queries / output / MLP (never read) and the reference's
    prompt padding."""
    v, lm, ex = cfg.vision, cfg.llm, cfg.expert
    t_img = (cfg.image.pad_to_square // v.patch_size) ** 2
    d = v.hidden_size
    vit_layer = 2 * t_img * (4 * d * d + 2 * d * v.intermediate_size) + 4 * t_img * t_img * d
    vit = cfg.num_cameras * (v.num_layers * vit_layer + 2 * t_img * d * lm.hidden_size)
    p, s = cfg.num_cameras * t_img + text_len + cfg.max_state_dim, cfg.action_horizon
    hd, nh, nkv = lm.head_dim, lm.num_heads, lm.num_kv_heads

    def proj(width: int, mlp: int, tokens: int, with_q_out: bool = True) -> float:
        qo, mlp_f = (2 * width * nh * hd, 3 * width * mlp) if with_q_out else (0, 0)
        return 2 * tokens * (qo + 2 * width * nkv * hd + mlp_f)

    layers = 0.0
    for i in range(lm.num_layers):
        last = i == lm.num_layers - 1
        layers += proj(lm.hidden_size, lm.intermediate_size, p, with_q_out=not last)
        layers += proj(ex.hidden_size, ex.intermediate_size, s)
        layers += 4 * (s + (0 if last else p)) * (p + s) * nh * hd
        layers += 2 * s * 3 * ex.hidden_size * ex.hidden_size * 2  # adaRMS modulations
    a, we = cfg.action_dim, ex.hidden_size
    return float(3 * (vit + layers + 2 * s * (2 * a * we) + 2 * 2 * we * we))

"""Hugging Face <-> longboat state dicts of the SigLIP tower (unsharded, TP=1).

HF keeps separate ``q_proj`` / ``k_proj`` / ``v_proj``; megatron's fused ``linear_qkv``
interleaves them per head (q, k, v of head 0, then head 1, ...). The HF names are those of
the SigLIP vision transformer (``embeddings.*``, ``encoder.layers.*``, ``post_layernorm.*``)
after ``prefix`` (e.g. ``model.vision_tower.``, or ``vision_tower.vision_model.`` in older
files). The final
``post_layernorm`` is not ours (LLaVA-style VLMs read the blocks' output before it): it is
skipped on load and written as the identity on save, so the files stay complete.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from longboat.vlm.models.siglip.config import SiglipVisionConfig


def _pairs(cfg: SiglipVisionConfig) -> dict[str, str]:
    """Our names -> HF names (after the prefix) of tensors that map one to one."""
    out = {
        "patch_embed.weight": "embeddings.patch_embedding.weight",
        "patch_embed.bias": "embeddings.patch_embedding.bias",
    }
    for i in range(cfg.num_layers):
        o, h = f"layers.{i}.", f"encoder.layers.{i}."
        for kind in ("weight", "bias"):
            out |= {
                f"{o}input_layernorm.{kind}": f"{h}layer_norm1.{kind}",
                f"{o}pre_mlp_layernorm.{kind}": f"{h}layer_norm2.{kind}",
                f"{o}self_attention.linear_proj.{kind}": f"{h}self_attn.out_proj.{kind}",
                f"{o}mlp.linear_fc1.{kind}": f"{h}mlp.fc1.{kind}",
                f"{o}mlp.linear_fc2.{kind}": f"{h}mlp.fc2.{kind}",
            }
    return out


def siglip_from_hf(
    hf: Mapping[str, torch.Tensor], cfg: SiglipVisionConfig, prefix: str
) -> dict[str, torch.Tensor]:
    """Our tower state dict from the HF tensors named ``prefix + ...``; raises ``KeyError``
    naming the first missing tensor."""
    p = prefix
    out = {ours: hf[p + theirs] for ours, theirs in _pairs(cfg).items()}
    pos = hf[p + "embeddings.position_embedding.weight"]
    out["position_embedding"] = pos
    n, d = cfg.num_heads, cfg.head_dim
    for i in range(cfg.num_layers):
        h = f"{p}encoder.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            q, k, v = (hf[f"{h}{x}_proj.{kind}"] for x in "qkv")
            tail = q.shape[1:]
            fused = torch.stack([t.reshape(n, d, *tail) for t in (q, k, v)], dim=1)
            out[f"layers.{i}.self_attention.linear_qkv.{kind}"] = fused.reshape(3 * n * d, *tail)
    return out


def siglip_to_hf(
    ours: Mapping[str, torch.Tensor], cfg: SiglipVisionConfig, prefix: str
) -> dict[str, torch.Tensor]:
    """The HF tensors (``prefix + ...``) of our tower state dict."""
    p = prefix
    out = {p + theirs: ours[mine] for mine, theirs in _pairs(cfg).items()}
    out[p + "embeddings.position_embedding.weight"] = ours["position_embedding"]
    n, d = cfg.num_heads, cfg.head_dim
    for i in range(cfg.num_layers):
        h = f"{p}encoder.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            fused = ours[f"layers.{i}.self_attention.linear_qkv.{kind}"]
            tail = fused.shape[1:]
            q, k, v = fused.reshape(n, 3, d, *tail).unbind(1)
            for name, t in zip("qkv", (q, k, v), strict=True):
                out[f"{h}{name}_proj.{kind}"] = t.reshape(n * d, *tail).contiguous()
    ref = ours["patch_embed.bias"]
    out[p + "post_layernorm.weight"] = torch.ones_like(ref)
    out[p + "post_layernorm.bias"] = torch.zeros_like(ref)
    return out

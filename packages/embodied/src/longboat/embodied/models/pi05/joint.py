"""pi0.5's two-expert transformer: the Gemma VLM (prefix) and the action expert (suffix)
keep their own weights but share one attention per layer over the concatenated sequence.

Masks are bool, True = may attend: the prefix is bidirectional over valid prefix tokens,
the suffix sees the valid prefix and all of itself, the prefix never sees the suffix.
Because of the last rule, the prefix K/V of every layer can be cached once and reused
by every denoising step (``prefix_cache`` + ``suffix_with_cache``).

In the last layer only the suffix queries matter (the prefix output is never read), so
the LM's last-layer q_proj / o_proj / MLP are skipped (the model keeps them frozen).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longboat.embodied.models.common import ops
from longboat.embodied.models.common.layers import ensure_row_nonempty
from longboat.embodied.models.common.lm import DecoderStack

KVCache = list[tuple[Tensor, Tensor]]


def prefix_lm_mask(prefix_valid: Tensor, suffix_len: int) -> Tensor:
    """[B, P] bool -> [B, 1, P+S, P+S] prefix-LM mask."""
    b, p = prefix_valid.shape
    dev = prefix_valid.device
    valid = torch.cat([prefix_valid, torch.ones(b, suffix_len, dtype=torch.bool, device=dev)], 1)
    is_suffix = torch.arange(p + suffix_len, device=dev) >= p
    # Key j is visible to query i when j is valid and (j is prefix or i is suffix).
    allowed = valid[:, None, :] & (~is_suffix[None, None, :] | is_suffix[None, :, None])
    return ensure_row_nonempty(allowed)[:, None]


def joint_positions(prefix_valid: Tensor, suffix_len: int) -> tuple[Tensor, Tensor]:
    """RoPE positions: prefix = running count of valid tokens, suffix continues after them."""
    pos_p = (prefix_valid.long().cumsum(-1) - 1).clamp_min(0)
    n_valid = prefix_valid.long().sum(-1, keepdim=True)
    pos_s = n_valid + torch.arange(suffix_len, device=prefix_valid.device)[None]
    return pos_p, pos_s


class JointTransformer:
    """Runs the prefix through ``llm`` and the suffix through ``expert`` with joint attention.

    A plain object (not an ``nn.Module``) so the weights are registered once, by the model."""

    def __init__(self, llm: DecoderStack, expert: DecoderStack) -> None:
        self.llm = llm
        self.expert = expert

    def unused_parameters(self) -> list[nn.Parameter]:
        """LM parameters that cannot affect the suffix output (last layer's prefix path)."""
        last = self.llm.layers[-1]
        mods = [last.q_proj, last.o_proj, last.post_attention_norm, last.mlp]
        if last.q_norm is not None:
            mods.append(last.q_norm)
        return [p for m in mods for p in m.parameters()]

    def __call__(
        self,
        prefix: Tensor,
        prefix_valid: Tensor,
        suffix: Tensor,
        cond: Tensor,
        *,
        full_prefix: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """One pass over [prefix, suffix]. Returns (prefix hidden, suffix hidden before the
        final norm); the prefix hidden skips the last layer unless ``full_prefix``."""
        p, s = prefix.shape[1], suffix.shape[1]
        mask = prefix_lm_mask(prefix_valid, s)
        pos_p, pos_s = joint_positions(prefix_valid, s)
        rope_p = self.llm.rope(pos_p, p + s)
        rope_s = self.expert.rope(pos_s, p + s)
        n = len(self.llm.layers)
        for i, (lm, ex) in enumerate(zip(self.llm.layers, self.expert.layers, strict=True)):
            last = i == n - 1 and not full_prefix
            qp, kp, vp, _ = lm.project_qkv(prefix, rope_p)
            qs, ks, vs, gate = ex.project_qkv(suffix, rope_s, cond)
            k, v = _cat(kp, ks), _cat(vp, vs)
            if last:
                out_s = ops.attention(qs, k, v, mask[:, :, p:])
            else:
                out = ops.attention(_cat(qp, qs), k, v, mask)
                out_p, out_s = out[:, :, :p], out[:, :, p:]
                prefix = lm.finish(prefix, out_p, None)
            suffix = ex.finish(suffix, out_s, gate, cond)
        return prefix, suffix

    @torch.no_grad()
    def prefix_cache(self, prefix: Tensor, prefix_valid: Tensor) -> KVCache:
        """Per-layer rotated prefix K/V (the prefix never attends to the suffix)."""
        mask = prefix_lm_mask(prefix_valid, 0)
        pos_p, _ = joint_positions(prefix_valid, 0)
        rope = self.llm.rope(pos_p)
        cache: KVCache = []
        n = len(self.llm.layers)
        for i, lm in enumerate(self.llm.layers):
            q, k, v, _ = lm.project_qkv(prefix, rope)
            cache.append((k, v))
            if i < n - 1:
                prefix = lm.finish(prefix, ops.attention(q, k, v, mask), None)
        return cache

    def suffix_with_cache(
        self, suffix: Tensor, cache: KVCache, prefix_valid: Tensor, cond: Tensor
    ) -> Tensor:
        """Suffix pass attending to cached prefix K/V plus itself."""
        s = suffix.shape[1]
        mask = prefix_lm_mask(prefix_valid, s)[:, :, prefix_valid.shape[1] :]
        _, pos_s = joint_positions(prefix_valid, s)
        rope = self.expert.rope(pos_s, prefix_valid.shape[1] + s)
        for ex, (kp, vp) in zip(self.expert.layers, cache, strict=True):
            qs, ks, vs, gate = ex.project_qkv(suffix, rope, cond)
            out = ops.attention(qs, _cat(kp, ks), _cat(vp, vs), mask)
            suffix = ex.finish(suffix, out, gate, cond)
        return suffix


def _cat(a: Tensor, b: Tensor) -> Tensor:
    dtype = torch.promote_types(a.dtype, b.dtype)
    return torch.cat([a.to(dtype), b.to(dtype)], dim=2)

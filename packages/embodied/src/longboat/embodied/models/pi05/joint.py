"""pi0.5's two-expert transformer: the Gemma VLM (prefix) and the action expert (suffix)
keep their own weights but share one attention per layer over the concatenated sequence.

Masks are bool, True = may attend: the prefix is bidirectional over valid prefix tokens,
the suffix sees the valid prefix and all of itself, the prefix never sees the suffix.
Because of the last rule, the prefix K/V of every layer can be cached once and reused
by every denoising step (``prefix_cache`` + ``suffix_with_cache``).

In the last layer only the suffix queries matter (the prefix output is never read), so
the LM's last-layer q_proj / o_proj / MLP are skipped (the model keeps them frozen).

Each ``JointLayer`` is one module whose ``forward`` runs every path, so FSDP2 units and
activation-checkpoint wrappers placed on it see all of its work.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longboat.embodied.models.common import ops
from longboat.embodied.models.common.layers import ensure_row_nonempty
from longboat.embodied.models.common.lm import DecoderConfig, DecoderLayer, Rope

KV = tuple[Tensor, Tensor]
KVCache = list[KV]


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


def _cat(a: Tensor, b: Tensor) -> Tensor:
    dtype = torch.promote_types(a.dtype, b.dtype)
    return torch.cat([a.to(dtype), b.to(dtype)], dim=2)


class JointLayer(nn.Module):
    """One layer of both experts (``lm`` for the prefix, ``expert`` for the suffix)."""

    def __init__(self, llm: DecoderConfig, expert: DecoderConfig) -> None:
        super().__init__()
        self.lm = DecoderLayer(llm)
        self.expert = DecoderLayer(expert, cond_dim=expert.hidden_size)

    def forward(
        self,
        prefix: Tensor | None,
        suffix: Tensor | None,
        rope_p: Rope | None,
        rope_s: Rope | None,
        mask: Tensor,
        cond: Tensor | None = None,
        prefix_kv: KV | None = None,
        need_prefix: bool = True,
    ) -> tuple[Tensor | None, Tensor | None, KV | None]:
        """Three paths, returning (prefix out, suffix out, prefix K/V):

        - joint: ``prefix`` and ``suffix`` given; ``mask`` [B, 1, P+S, P+S];
        - prefix only: ``suffix=None``; ``mask`` [B, 1, P, P];
        - cached suffix: ``prefix=None``, ``prefix_kv`` given; ``mask`` [B, 1, S, P+S].

        ``need_prefix=False`` skips the prefix queries, output projection and MLP."""
        out_p = out_s = kv = None
        if prefix is not None:
            qp, kp, vp, _ = self.lm.project_qkv(prefix, rope_p, need_q=need_prefix)
            kv = (kp, vp)
        if suffix is None:  # prefix only
            if need_prefix:
                out_p = self.lm.finish(prefix, ops.attention(qp, kp, vp, mask), None)
            return out_p, None, kv
        qs, ks, vs, gate = self.expert.project_qkv(suffix, rope_s, cond)
        if prefix is None:  # cached suffix
            if prefix_kv is None:
                raise ValueError("JointLayer: a suffix-only call needs prefix_kv")
            kp, vp = prefix_kv
        k, v = _cat(kp, ks), _cat(vp, vs)
        p = kp.shape[2]
        if prefix is not None and need_prefix:
            att = ops.attention(_cat(qp, qs), k, v, mask)
            out_p = self.lm.finish(prefix, att[:, :, :p], None)
            att_s = att[:, :, p:]
        else:
            att_s = ops.attention(qs, k, v, mask if prefix is None else mask[:, :, p:])
        out_s = self.expert.finish(suffix, att_s, gate, cond)
        return out_p, out_s, kv


class JointTransformer(nn.Module):
    """The stack of joint layers plus the rotary tables of both experts."""

    def __init__(self, llm: DecoderConfig, expert: DecoderConfig) -> None:
        super().__init__()
        self.llm_cfg = llm
        self.layers = nn.ModuleList(JointLayer(llm, expert) for _ in range(llm.num_layers))

    def _rope(self, positions: Tensor, length: int) -> Rope:
        # Both experts share head_dim (checked by Pi05Config) and the Gemma RoPE base.
        cos, sin = ops.rope_tables(
            length, self.llm_cfg.head_dim, self.llm_cfg.rope_theta, positions.device
        )
        return cos, sin, positions

    def unused_parameters(self) -> list[nn.Parameter]:
        """LM parameters that cannot affect the suffix output (last layer's prefix path)."""
        last = self.layers[-1].lm
        mods = [last.q_proj, last.o_proj, last.post_attention_norm, last.mlp]
        if last.q_norm is not None:
            mods.append(last.q_norm)
        return [p for m in mods for p in m.parameters()]

    def forward(
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
        rope_p, rope_s = self._rope(pos_p, p + s), self._rope(pos_s, p + s)
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            need = full_prefix or i < n - 1
            out_p, suffix, _ = layer(prefix, suffix, rope_p, rope_s, mask, cond, need_prefix=need)
            prefix = out_p if out_p is not None else prefix
        return prefix, suffix

    @torch.no_grad()
    def prefix_cache(self, prefix: Tensor, prefix_valid: Tensor) -> KVCache:
        """Per-layer rotated prefix K/V (the prefix never attends to the suffix)."""
        mask = prefix_lm_mask(prefix_valid, 0)
        pos_p, _ = joint_positions(prefix_valid, 0)
        rope = self._rope(pos_p, prefix.shape[1])
        cache: KVCache = []
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            out_p, _, kv = layer(prefix, None, rope, None, mask, need_prefix=i < n - 1)
            assert kv is not None
            cache.append(kv)
            prefix = out_p if out_p is not None else prefix
        return cache

    def suffix_with_cache(
        self, suffix: Tensor, cache: KVCache, prefix_valid: Tensor, cond: Tensor
    ) -> Tensor:
        """Suffix pass attending to cached prefix K/V plus itself."""
        p, s = prefix_valid.shape[1], suffix.shape[1]
        mask = prefix_lm_mask(prefix_valid, s)[:, :, p:]
        _, pos_s = joint_positions(prefix_valid, s)
        rope = self._rope(pos_s, p + s)
        for layer, kv in zip(self.layers, cache, strict=True):
            _, out, _ = layer(None, suffix, None, rope, mask, cond, prefix_kv=kv)
            assert out is not None
            suffix = out
        return suffix

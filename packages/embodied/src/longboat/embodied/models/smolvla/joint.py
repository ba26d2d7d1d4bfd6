"""SmolVLA's interleaved transformer: text layer i (the prefix) and expert layer i (the
suffix, the noisy action tokens) side by side.

The prefix never attends to the suffix, so every layer's rotated prefix keys and values
can be computed once (``prefix_cache``) and reused by every denoising step. The suffix
reads them two ways:

- self-attention layers: the expert's own queries, keys and values over the suffix,
  concatenated after the prefix's keys and values (prefix: where valid; suffix: causal);
- cross-attention layers: the expert's queries attend to the prefix's keys and values only,
  each projected from the text model's key/value width to the expert's by the expert
  layer's own ``k_proj`` / ``v_proj``; the queries' rotary positions restart at 0.

In the last layer the prefix's output is never read, so the text layer's query projection,
output projection and MLP are skipped there (the model keeps them frozen), and the text
model's final norm does not exist here.

Masks are bool, True = may attend. Each ``SmolVLALayer`` is one module whose ``forward``
runs every path, so FSDP2 units and activation-checkpoint wrappers see all of its work.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longboat.embodied.models.common import ops
from longboat.embodied.models.common.layers import ensure_row_nonempty
from longboat.embodied.models.common.lm import DecoderConfig, DecoderLayer, Rope

KV = tuple[Tensor, Tensor]


def prefix_mask(valid: Tensor, causal_from: Tensor) -> Tensor:
    """[B, P] valid tokens and [P] block starts (1 where a token opens a block no earlier
    token sees: the state token) -> [B, 1, P, P]: a token sees the valid tokens of its own
    and earlier blocks."""
    block = causal_from.long().cumsum(0)
    allowed = block[None, :] <= block[:, None]
    pair = valid[:, None, :] & valid[:, :, None] & allowed[None]
    return ensure_row_nonempty(pair)[:, None]


def suffix_mask(prefix_valid: Tensor, suffix_len: int) -> Tensor:
    """[B, 1, S, P+S]: every suffix token sees the valid prefix and the suffix up to itself."""
    b, p = prefix_valid.shape
    dev = prefix_valid.device
    causal = torch.ones(suffix_len, suffix_len, dtype=torch.bool, device=dev).tril()
    left = prefix_valid[:, None, :].expand(b, suffix_len, p)
    return torch.cat([left, causal[None].expand(b, -1, -1)], dim=2)[:, None]


class SmolVLALayer(nn.Module):
    """Text layer ``lm`` (prefix) and expert layer ``expert`` (suffix) of one depth."""

    def __init__(self, text: DecoderConfig, expert: DecoderConfig, cross: bool) -> None:
        super().__init__()
        self.cross = cross
        self.lm = DecoderLayer(text)
        self.expert = DecoderLayer(expert)
        if cross:  # keys / values come from the text model's, not from the expert's stream
            kv_in = text.num_kv_heads * text.head_dim
            kv_out = expert.num_kv_heads * expert.head_dim
            self.expert.k_proj = nn.Linear(kv_in, kv_out, bias=False)
            self.expert.v_proj = nn.Linear(kv_in, kv_out, bias=False)

    def prefix_kv(
        self, prefix: Tensor, rope: Rope, mask: Tensor, need_out: bool
    ) -> tuple[Tensor | None, KV]:
        """Prefix out (None without ``need_out``) and its rotated K/V [B, Hkv, P, hd]."""
        q, k, v, _ = self.lm.project_qkv(prefix, rope, need_q=need_out)
        out = self.lm.finish(prefix, ops.attention(q, k, v, mask), None) if need_out else None
        return out, (k, v)

    def _cross_qkv(self, suffix: Tensor, kv: KV, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
        ex = self.expert
        b, s, _ = suffix.shape
        hd = ex.cfg.head_dim
        h = ex.input_norm(suffix.to(ex.dtype))
        q = ex.q_proj(h.to(ex.q_proj.weight.dtype)).view(b, s, -1, hd)
        q, _ = ops.apply_rope(q, q, *rope)
        k, v = (t.transpose(1, 2).flatten(2) for t in kv)  # [B, P, Hkv * hd]
        p = k.shape[1]
        k = ex.k_proj(k.to(ex.k_proj.weight.dtype)).view(b, p, -1, hd)
        v = ex.v_proj(v.to(ex.v_proj.weight.dtype)).view(b, p, -1, hd)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def suffix_out(
        self, suffix: Tensor, kv: KV, rope_s: Rope, rope_cross: Rope, mask: Tensor
    ) -> Tensor:
        """The expert's output for ``suffix`` given the prefix's K/V; ``mask`` [B, 1, S, P+S]."""
        p = kv[0].shape[2]
        if self.cross:
            q, k, v = self._cross_qkv(suffix, kv, rope_cross)
            att = ops.attention(q, k, v, mask[..., :p])
        else:
            q, ks, vs, _ = self.expert.project_qkv(suffix, rope_s)
            dtype = torch.promote_types(kv[0].dtype, ks.dtype)
            k = torch.cat([kv[0].to(dtype), ks.to(dtype)], dim=2)
            v = torch.cat([kv[1].to(dtype), vs.to(dtype)], dim=2)
            att = ops.attention(q, k, v, mask)
        return self.expert.finish(suffix, att, None)

    def forward(
        self,
        prefix: Tensor | None,
        suffix: Tensor | None,
        ropes: tuple[Rope | None, Rope | None, Rope | None],
        masks: tuple[Tensor | None, Tensor | None],
        prefix_kv: KV | None = None,
        need_prefix: bool = True,
    ) -> tuple[Tensor | None, Tensor | None, KV]:
        """(prefix out, suffix out, prefix K/V). ``ropes`` = (prefix, suffix, cross-attention
        queries), ``masks`` = (prefix [B, 1, P, P], suffix [B, 1, S, P+S]). Without
        ``prefix`` the cached ``prefix_kv`` is read; without ``suffix`` only the prefix runs;
        ``need_prefix=False`` skips the prefix's output."""
        rope_p, rope_s, rope_c = ropes
        out_p = None
        if prefix is not None:
            assert rope_p is not None and masks[0] is not None
            out_p, prefix_kv = self.prefix_kv(prefix, rope_p, masks[0], need_prefix)
        if prefix_kv is None:
            raise ValueError("SmolVLALayer: pass prefix or prefix_kv")
        if suffix is None:
            return out_p, None, prefix_kv
        assert rope_s is not None and rope_c is not None and masks[1] is not None
        return out_p, self.suffix_out(suffix, prefix_kv, rope_s, rope_c, masks[1]), prefix_kv


class SmolVLATransformer(nn.Module):
    """The stack of ``SmolVLALayer``s and the shared rotary tables."""

    def __init__(self, text: DecoderConfig, expert: DecoderConfig, cross: list[bool]) -> None:
        super().__init__()
        self.text_cfg = text
        self.layers = nn.ModuleList(SmolVLALayer(text, expert, c) for c in cross)

    def rope(self, positions: Tensor, length: int) -> Rope:
        """Rotary tables (text and expert share head_dim and base) at ``positions``."""
        cos, sin = ops.rope_tables(
            length, self.text_cfg.head_dim, self.text_cfg.rope_theta, positions.device
        )
        return cos, sin, positions

    def unused_parameters(self) -> list[nn.Parameter]:
        """Text parameters that cannot affect the suffix (the last layer's prefix output)."""
        last = self.layers[-1].lm
        mods = [last.q_proj, last.o_proj, last.post_attention_norm, last.mlp]
        return [p for m in mods for p in m.parameters()]

    def _positions(
        self, prefix_valid: Tensor, suffix_len: int
    ) -> tuple[Rope, Rope | None, Rope | None]:
        p = prefix_valid.shape[1]
        length = p + suffix_len
        pos_p = (prefix_valid.long().cumsum(-1) - 1).clamp_min(0)
        rope_p = self.rope(pos_p, length)
        if not suffix_len:
            return rope_p, None, None
        steps = torch.arange(suffix_len, device=prefix_valid.device)[None]
        pos_s = prefix_valid.long().sum(-1, keepdim=True) + steps
        b = prefix_valid.shape[0]
        return rope_p, self.rope(pos_s, length), self.rope(steps.expand(b, -1), length)

    def forward(
        self, prefix: Tensor, prefix_valid: Tensor, prefix_blocks: Tensor, suffix: Tensor
    ) -> Tensor:
        """One pass over prefix and suffix; the suffix hidden state before the final norm."""
        s = suffix.shape[1]
        ropes = self._positions(prefix_valid, s)
        masks = (prefix_mask(prefix_valid, prefix_blocks), suffix_mask(prefix_valid, s))
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            out_p, out_s, _ = layer(prefix, suffix, ropes, masks, need_prefix=i < n - 1)
            prefix = out_p if out_p is not None else prefix
            assert out_s is not None
            suffix = out_s
        return suffix

    @torch.no_grad()
    def prefix_cache(self, prefix: Tensor, prefix_valid: Tensor, prefix_blocks: Tensor) -> list[KV]:
        """Every layer's rotated prefix K/V."""
        rope_p, _, _ = self._positions(prefix_valid, 0)
        masks = (prefix_mask(prefix_valid, prefix_blocks), None)
        cache: list[KV] = []
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            out_p, _, kv = layer(prefix, None, (rope_p, None, None), masks, need_prefix=i < n - 1)
            cache.append(kv)
            prefix = out_p if out_p is not None else prefix
        return cache

    def suffix_with_cache(self, suffix: Tensor, cache: list[KV], prefix_valid: Tensor) -> Tensor:
        """The suffix pass over cached prefix K/V."""
        s = suffix.shape[1]
        _, rope_s, rope_c = self._positions(prefix_valid, s)
        masks = (None, suffix_mask(prefix_valid, s))
        for layer, kv in zip(self.layers, cache, strict=True):
            _, out, _ = layer(None, suffix, (None, rope_s, rope_c), masks, prefix_kv=kv)
            assert out is not None
            suffix = out
        return suffix

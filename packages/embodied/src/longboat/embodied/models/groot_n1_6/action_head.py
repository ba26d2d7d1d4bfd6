"""GR00T N1.6 action head: vlln, per-embodiment state/action encoders and decoder, the
alternating DiT, flow-matching loss and Euler sampling."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longboat.embodied.models.common import ops
from longboat.embodied.models.common.category_specific import (
    CategorySpecificLinear,
    CategorySpecificMLP,
)
from longboat.embodied.models.common.dit import AlternatingDiT
from longboat.embodied.models.common.layers import safe_key_mask, sinusoidal_embedding
from longboat.embodied.models.groot_n1_6.config import GrootN16Config


class MultiEmbodimentActionEncoder(nn.Module):
    """W1(a) ++ sinusoidal(tau) -> W2 -> swish -> W3, all per embodiment."""

    def __init__(self, cfg: GrootN16Config) -> None:
        super().__init__()
        d, e, impl = cfg.dit.inner_dim, cfg.num_embodiments, cfg.category_impl
        self.dim = d
        self.W1 = CategorySpecificLinear(e, cfg.max_action_dim, d, impl)
        self.W2 = CategorySpecificLinear(e, 2 * d, d, impl)
        self.W3 = CategorySpecificLinear(e, d, d, impl)

    def forward(self, actions: Tensor, timesteps: Tensor, ids: Tensor) -> Tensor:
        """actions [B, H, A]; timesteps [B] (bucketed); ids [B] -> [B, H, D]."""
        a = self.W1(actions, ids)
        tau = sinusoidal_embedding(timesteps[:, None].expand(-1, actions.shape[1]), self.dim)
        x = ops.silu(self.W2(torch.cat([a, tau.to(a.dtype)], dim=-1), ids))
        return self.W3(x, ids)


class GrootActionHead(nn.Module):
    """Flow-matching DiT policy conditioned on backbone features."""

    def __init__(self, cfg: GrootN16Config) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dit.inner_dim
        self.vlln = nn.LayerNorm(cfg.llm.hidden_size)
        self.state_encoder = CategorySpecificMLP(
            cfg.num_embodiments, cfg.max_state_dim, cfg.state_hidden, d, cfg.category_impl
        )
        # Only built when used: an unused parameter would trip DDP's unused-gradient check.
        self.mask_token = nn.Parameter(torch.empty(1, 1, d)) if cfg.state_dropout_prob > 0 else None
        self.action_encoder = MultiEmbodimentActionEncoder(cfg)
        self.position_embedding = nn.Embedding(cfg.max_seq_len, d)
        self.model = AlternatingDiT(cfg.dit)
        self.action_decoder = CategorySpecificMLP(
            cfg.num_embodiments,
            cfg.dit.output_dim,
            cfg.action_decoder_hidden,
            cfg.max_action_dim,
            cfg.category_impl,
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) state mask token (submodules reset themselves)."""
        if self.mask_token is not None:
            nn.init.normal_(self.mask_token, std=0.02)

    def condition(
        self, features: Tensor, valid: Tensor, is_image: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """vlln(features) and the text / image cross-attention masks."""
        feats = ops.layer_norm(features, self.vlln.weight, self.vlln.bias, self.vlln.eps)
        return feats, safe_key_mask(valid & ~is_image), safe_key_mask(is_image)

    def encode_state(
        self, state: Tensor, ids: Tensor, generator: torch.Generator | None = None
    ) -> Tensor:
        """state [B, S] -> one token [B, 1, D] (optionally dropped to the mask token)."""
        tok = self.state_encoder(state, ids)[:, None]
        p = self.cfg.state_dropout_prob
        if self.training and p > 0 and self.mask_token is not None:
            gen_device = generator.device if generator is not None else tok.device
            drop = torch.rand(tok.shape[0], generator=generator, device=gen_device) < p
            tok = torch.where(
                drop.to(tok.device)[:, None, None], self.mask_token.to(tok.dtype), tok
            )
        return tok

    def velocity(
        self,
        state_tok: Tensor,
        x_t: Tensor,
        t: Tensor,
        ids: Tensor,
        cond: tuple[Tensor, Tensor, Tensor],
    ) -> Tensor:
        """Predicted velocity [B, H, A] for noisy actions x_t at continuous times t [B]."""
        buckets = (t * self.cfg.num_timestep_buckets).long()
        horizon = x_t.shape[1]
        if horizon > self.cfg.max_seq_len:
            raise ValueError(f"action horizon {horizon} exceeds max_seq_len={self.cfg.max_seq_len}")
        act = self.action_encoder(x_t, buckets, ids)
        act = act + self.position_embedding.weight[:horizon].to(act.dtype)
        tokens = torch.cat([state_tok.to(act.dtype), act], dim=1)
        feats, text_mask, image_mask = cond
        out = self.model(tokens, buckets, feats, text_mask, image_mask)
        return self.action_decoder(out, ids)[:, -horizon:]

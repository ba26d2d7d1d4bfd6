"""SmolVLA policy: ``forward(batch) -> {"loss", ...}`` and ``predict_action(batch)``.

Batch dict (all tensors on the model's device):

=================  ===========================  =========================================
key                shape / dtype                meaning
=================  ===========================  =========================================
images             [B, n_cams, 3, H, W]         camera frames, uint8 or float in [0, 1]
image_mask         [B, n_cams] bool             optional; False = missing camera
input_ids          [B, L] int64                 tokenised task prompt
attention_mask     [B, L] bool/int              1 = real token
state              [B, max_state_dim] float     normalised, zero-padded; one prefix token
action             [B, H, action_dim] float     padded action chunk (training only)
action_mask        broadcastable to action      1 = real (step, dim); loss is masked by it
noise, time        [B, H, A], [B] (optional)    fix the flow-matching draw (tests, parity)
=================  ===========================  =========================================

Prefix = [image tokens of each camera, text tokens, state token]: images and text attend to
each other, the state token to all of them; suffix = the H noisy action tokens (each fused
with the time embedding by a two-layer MLP), causal among themselves.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longboat.embodied.models.common import ops
from longboat.embodied.models.common.flow_matching import (
    euler_integrate,
    flow_loss_outputs,
    pi0_training_inputs,
    randn_like_gen,
)
from longboat.embodied.models.common.freezing import FreezingGroups
from longboat.embodied.models.common.layers import RMSNorm
from longboat.embodied.models.common.vit import VisionTransformer
from longboat.embodied.models.smolvla.config import SmolVLAConfig
from longboat.embodied.models.smolvla.joint import SmolVLATransformer


def resize_pad_top_left(images: Tensor, height: int, width: int) -> Tensor:
    """[N, 3, h, w] float -> [N, 3, height, width]: bilinear resize keeping the aspect ratio,
    then zero padding on the top and left (SmolVLA's convention)."""
    h, w = images.shape[-2:]
    if (h, w) == (height, width):
        return images
    ratio = max(w / width, h / height)
    rh, rw = int(h / ratio), int(w / ratio)
    out = F.interpolate(images, size=(rh, rw), mode="bilinear", align_corners=False)
    return F.pad(out, (max(0, width - rw), 0, max(0, height - rh), 0), value=0.0)


def pixel_shuffle(tokens: Tensor, factor: int) -> Tensor:
    """[N, G*G, D] patch tokens (row-major) -> [N, G*G/factor^2, D*factor^2]: each token
    gathers a factor x factor neighbourhood (the SmolVLM connector's order)."""
    n, seq, d = tokens.shape
    side = math.isqrt(seq)
    x = tokens.reshape(n, side, side // factor, d * factor).transpose(1, 2)
    x = x.reshape(n, side // factor, side // factor, d * factor * factor).transpose(1, 2)
    return x.reshape(n, seq // factor**2, d * factor * factor)


def time_embedding(t: Tensor, dim: int, min_period: float, max_period: float) -> Tensor:
    """sin-cos embedding of t [B] with periods spaced geometrically in [min, max], computed
    in float64 where the device has it (the reference's precision) -> [B, dim] fp32."""
    dtype = torch.float32 if t.device.type == "mps" else torch.float64
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=dtype, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    args = (2 * math.pi / period)[None] * t.to(dtype)[:, None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=1).float()


class SmolVLA(nn.Module):
    """SmolVLA (our implementation, random init; LeRobot's weights load 1:1)."""

    config_class = SmolVLAConfig

    def __init__(self, cfg: SmolVLAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        wt, we = cfg.text.hidden_size, cfg.expert.hidden_size
        self.vision = VisionTransformer(cfg.vision)
        self.connector = nn.Linear(cfg.vision.hidden_size * cfg.scale_factor**2, wt, bias=False)
        self.embed_tokens = nn.Embedding(cfg.text.vocab_size, wt)
        cross = [cfg.is_cross_layer(i) for i in range(cfg.text.num_layers)]
        self.joint = SmolVLATransformer(cfg.text, cfg.expert, cross)
        self.expert_norm = RMSNorm(we, cfg.expert.rms_eps)
        self.state_proj = nn.Linear(cfg.max_state_dim, wt)
        self.action_in_proj = nn.Linear(cfg.action_dim, we)
        self.action_out_proj = nn.Linear(we, cfg.action_dim)
        self.action_time_mlp_in = nn.Linear(2 * we, we)
        self.action_time_mlp_out = nn.Linear(we, we)

    def parallel_blocks(self) -> list[nn.Module]:
        """Repeated blocks (units of FSDP sharding / activation checkpointing): ViT blocks and
        the interleaved layers (text + expert layer i), each run through its own forward."""
        return [*self.vision.blocks, *self.joint.layers]

    def freezing_groups(self) -> FreezingGroups:
        """Parts for ``apply_freezing`` (the state projection follows ``tune_state_proj``)."""
        action = [
            *(layer.expert for layer in self.joint.layers),
            self.expert_norm,
            self.action_in_proj,
            self.action_out_proj,
            self.action_time_mlp_in,
            self.action_time_mlp_out,
        ]
        frozen = list(self.joint.unused_parameters())
        if self.cfg.tune_state_proj:
            action.append(self.state_proj)
        else:
            frozen += list(self.state_proj.parameters())
        return FreezingGroups(
            visual=[self.vision, self.connector],
            llm_layers=[layer.lm for layer in self.joint.layers],
            llm_rest=[self.embed_tokens],
            action_head=action,
            always_frozen=frozen,
        )

    # ---- prefix / suffix -----------------------------------------------------------------

    def _check(self, batch: dict[str, Tensor], need_action: bool) -> None:
        keys = ["images", "input_ids", "attention_mask", "state"]
        keys += ["action"] if need_action else []
        missing = [k for k in keys if k not in batch]
        if missing:
            raise KeyError(f"smolvla batch is missing {missing}; see SmolVLA's docstring")
        if batch["state"].shape[-1] != self.cfg.max_state_dim:
            raise ValueError(
                f"batch['state'] has {batch['state'].shape[-1]} dims, model expects "
                f"max_state_dim={self.cfg.max_state_dim} (pad the state)"
            )
        if need_action and batch["action"].shape[-1] != self.cfg.action_dim:
            raise ValueError(
                f"batch['action'] has {batch['action'].shape[-1]} dims, model expects "
                f"action_dim={self.cfg.action_dim} (pad the action)"
            )
        if batch["images"].dim() != 5:
            raise ValueError(
                f"batch['images'] must be [B, n_cams, 3, H, W], got {tuple(batch['images'].shape)}"
            )

    def embed_images(self, images: Tensor) -> Tensor:
        """[B, C, 3, H, W] (uint8 or [0, 1]) -> [B, C * tokens, text width], scaled by
        sqrt(width)."""
        b, c = images.shape[:2]
        pix = images.flatten(0, 1)
        pix = pix.float() / 255.0 if pix.dtype == torch.uint8 else pix.float()
        pix = resize_pad_top_left(pix, *self.cfg.input_image_size()) * 2.0 - 1.0
        tokens, _ = self.vision(pix)
        tokens = pixel_shuffle(tokens, self.cfg.scale_factor)
        emb = self.connector(tokens.to(self.connector.weight.dtype))
        emb = emb * torch.tensor(emb.shape[-1] ** 0.5, dtype=emb.dtype)
        return emb.reshape(b, c * emb.shape[1], -1)

    def embed_prefix(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """-> (embeddings [B, P, D], valid [B, P], block starts [P]: 1 at the state token)."""
        images = batch["images"]
        b, c = images.shape[:2]
        img = self.embed_images(images)
        per_cam = img.shape[1] // c
        cam_mask = batch.get("image_mask")
        if cam_mask is None:
            cam_mask = torch.ones(b, c, dtype=torch.bool, device=img.device)
        img_valid = cam_mask.bool().repeat_interleave(per_cam, dim=1)
        text = self.embed_tokens(batch["input_ids"])
        text = text * math.sqrt(text.shape[-1])
        w = self.state_proj.weight
        state = self.state_proj(batch["state"].to(w.dtype))[:, None]
        dtype = torch.promote_types(torch.promote_types(img.dtype, text.dtype), state.dtype)
        emb = torch.cat([img.to(dtype), text.to(dtype), state.to(dtype)], dim=1)
        state_valid = torch.ones(b, 1, dtype=torch.bool, device=emb.device)
        valid = torch.cat([img_valid, batch["attention_mask"].bool(), state_valid], dim=1)
        blocks = torch.zeros(emb.shape[1], dtype=torch.long, device=emb.device)
        blocks[-1] = 1
        return emb, valid, blocks

    def embed_suffix(self, x_t: Tensor, t: Tensor) -> Tensor:
        """Noisy actions [B, H, A] and times [B] -> action tokens [B, H, We]."""
        w = self.action_in_proj.weight
        act = self.action_in_proj(x_t.to(w.dtype))
        we = self.cfg.expert.hidden_size
        temb = time_embedding(t, we, self.cfg.time_min_period, self.cfg.time_max_period)
        temb = temb.to(act.dtype)[:, None].expand_as(act)
        h = self.action_time_mlp_in(torch.cat([act, temb], dim=2))
        return self.action_time_mlp_out(ops.silu(h))

    def _velocity(self, suffix_out: Tensor) -> Tensor:
        normed = self.expert_norm(suffix_out)
        w = self.action_out_proj.weight
        return self.action_out_proj(normed.float().to(w.dtype)).float()

    # ---- training and inference ----------------------------------------------------------

    def forward(
        self, batch: dict[str, Tensor], generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """Flow-matching training loss. Returns {"loss", "pred_velocity", "target_velocity"}."""
        self._check(batch, need_action=True)
        prefix, valid, blocks = self.embed_prefix(batch)
        action, mask, x_t, t, target = pi0_training_inputs(
            batch, generator, self.cfg.noise_beta_alpha
        )
        out = self.joint(prefix, valid, blocks, self.embed_suffix(x_t, t))
        pred = self._velocity(out)
        return flow_loss_outputs(pred, target, action, mask)

    @torch.no_grad()
    def predict_action(
        self,
        batch: dict[str, Tensor],
        *,
        num_steps: int | None = None,
        generator: torch.Generator | None = None,
        noise: Tensor | None = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Sample [B, action_horizon, action_dim] by Euler steps t: 1 -> 0. With
        ``use_cache`` the prefix runs once and its K/V serve every step."""
        self._check(batch, need_action=False)
        prefix, valid, blocks = self.embed_prefix(batch)
        b = prefix.shape[0]
        shape = (b, self.cfg.action_horizon, self.cfg.action_dim)
        if noise is None:
            noise = randn_like_gen(torch.empty(shape, device=prefix.device), generator)
        cache = self.joint.prefix_cache(prefix, valid, blocks) if use_cache else None

        def velocity(x: Tensor, t: float) -> Tensor:
            tt = torch.full((b,), t, device=x.device)
            suffix = self.embed_suffix(x, tt)
            if cache is None:
                return self._velocity(self.joint(prefix, valid, blocks, suffix))
            return self._velocity(self.joint.suffix_with_cache(suffix, cache, valid))

        steps = num_steps or self.cfg.num_inference_steps
        return euler_integrate(velocity, noise.float(), 1.0, 0.0, steps)

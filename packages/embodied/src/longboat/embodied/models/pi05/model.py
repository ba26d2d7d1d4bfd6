"""pi0.5 policy: ``forward(batch) -> {"loss", ...}`` and ``predict_action(batch)``.

Batch dict (all tensors on the model's device):

=================  ===========================  =========================================
key                shape / dtype                meaning
=================  ===========================  =========================================
images             [B, n_cams, 3, H, W]         camera frames, uint8 or float in [0, 1]
image_mask         [B, n_cams] bool             optional; False = missing camera
input_ids          [B, L] int64                 tokenised task prompt
attention_mask     [B, L] bool/int              1 = real token
state              [B, max_state_dim] float     normalised to [-1, 1]; becomes 256-bin
                                                tokens appended to the prompt (none with
                                                ``state_in_prompt``: the prompt spells it)
state_mask         [B, max_state_dim] bool      optional; 0 = padded dim (no token)
action             [B, H, action_dim] float     padded action chunk (training only)
action_mask        broadcastable to action      1 = real (step, dim); loss is masked by it
noise, time        [B, H, A], [B] (optional)    fix the flow-matching draw (tests, parity)
=================  ===========================  =========================================

Prefix = [image tokens, text tokens, state tokens]; suffix = the H noisy action tokens.
With ``cfg.state_in_prompt`` (LeRobot's format) the prefix ends with the text.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longboat.embodied.models.common import ops
from longboat.embodied.models.common.flow_matching import (
    euler_integrate,
    flow_loss_outputs,
    pi0_training_inputs,
    randn_like_gen,
)
from longboat.embodied.models.common.freezing import FreezingGroups
from longboat.embodied.models.common.image_preprocessing import preprocess_images
from longboat.embodied.models.common.layers import AdaRMSNorm, sincos_period_embedding
from longboat.embodied.models.common.vit import VisionTransformer
from longboat.embodied.models.pi05.config import Pi05Config
from longboat.embodied.models.pi05.joint import JointTransformer


def discretize_state(state: Tensor, num_bins: int) -> Tensor:
    """openpi's ``digitize(state, linspace(-1, 1, bins + 1)[:-1]) - 1``, clamped to
    [0, bins - 1]: [B, S] float -> [B, S] int64 bin indices."""
    edges = torch.linspace(-1.0, 1.0, num_bins + 1, device=state.device)[:-1]
    idx = torch.bucketize(state.float().contiguous(), edges, right=True) - 1
    return idx.clamp(0, num_bins - 1)


class Pi05(nn.Module):
    """pi0.5-style VLA (our implementation, random init)."""

    config_class = Pi05Config

    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        self.cfg = cfg
        we = cfg.expert.hidden_size
        self.vision = VisionTransformer(cfg.vision)
        self.projector = nn.Linear(cfg.vision.hidden_size, cfg.llm.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.llm.vocab_size, cfg.llm.hidden_size)
        self.joint = JointTransformer(cfg.llm, cfg.expert)
        self.expert_norm = AdaRMSNorm(we, we, cfg.expert.rms_eps)
        self.action_in_proj = nn.Linear(cfg.action_dim, we)
        self.action_out_proj = nn.Linear(we, cfg.action_dim)
        self.time_mlp_in = nn.Linear(we, we)
        self.time_mlp_out = nn.Linear(we, we)

    def parallel_blocks(self) -> list[nn.Module]:
        """Repeated blocks (units of FSDP sharding / activation checkpointing): ViT blocks and
        joint layers (LM + expert layer i), each run through its own ``forward``."""
        return [*self.vision.blocks, *self.joint.layers]

    def freezing_groups(self) -> FreezingGroups:
        """Parts for ``apply_freezing``."""
        return FreezingGroups(
            visual=[self.vision, self.projector],
            llm_layers=[layer.lm for layer in self.joint.layers],
            llm_rest=[self.embed_tokens],
            action_head=[
                *(layer.expert for layer in self.joint.layers),
                self.expert_norm,
                self.action_in_proj,
                self.action_out_proj,
                self.time_mlp_in,
                self.time_mlp_out,
            ],
            always_frozen=self.joint.unused_parameters(),
        )

    # ---- prefix / suffix embedding -------------------------------------------------------

    def embed(self, input_ids: Tensor) -> Tensor:
        """Gemma token embeddings (scaled by sqrt(hidden))."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.cfg.llm.hidden_size**0.5, dtype=x.dtype)

    def _check(self, batch: dict[str, Tensor], need_action: bool) -> None:
        keys = ["images", "input_ids", "attention_mask", "state"]
        keys += ["action"] if need_action else []
        missing = [k for k in keys if k not in batch]
        if missing:
            raise KeyError(f"pi05 batch is missing {missing}; see Pi05's docstring")
        if batch["state"].shape[-1] != self.cfg.max_state_dim:
            raise ValueError(
                f"batch['state'] has {batch['state'].shape[-1]} dims, model expects "
                f"max_state_dim={self.cfg.max_state_dim} (pad the state)"
            )
        n_state = 0 if self.cfg.state_in_prompt else self.cfg.max_state_dim
        n_tok = batch["input_ids"].shape[1] + n_state
        if n_tok > self.cfg.max_token_len:
            raise ValueError(
                f"prompt of {batch['input_ids'].shape[1]} text + {n_state} state "
                f"tokens exceeds max_token_len={self.cfg.max_token_len}; truncate the text"
            )
        if need_action and batch["action"].shape[-1] != self.cfg.action_dim:
            raise ValueError(
                f"batch['action'] has {batch['action'].shape[-1]} dims, model expects "
                f"action_dim={self.cfg.action_dim} (pad the action)"
            )

    def embed_prefix(
        self, batch: dict[str, Tensor], generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """[image tokens, text tokens, state tokens] -> (embeddings [B, P, D], valid [B, P])."""
        images = batch["images"]
        if images.dim() != 5:
            raise ValueError(f"batch['images'] must be [B, n_cams, 3, H, W], got {images.shape}")
        b, c = images.shape[:2]
        pix = preprocess_images(images, self.cfg.image, train=self.training, generator=generator)
        tokens, _ = self.vision(pix.flatten(0, 1))
        img = self.projector(tokens.to(self.projector.weight.dtype))
        t = img.shape[1]
        img = img.reshape(b, c * t, -1)
        cam_mask = batch.get("image_mask")
        if cam_mask is None:
            cam_mask = torch.ones(b, c, dtype=torch.bool, device=img.device)
        img_valid = cam_mask.bool().repeat_interleave(t, dim=1)
        text = self.embed(batch["input_ids"])
        text_valid = batch["attention_mask"].bool()
        dtype = torch.promote_types(img.dtype, text.dtype)
        if self.cfg.state_in_prompt:  # the tokenised prompt spells the state
            emb = torch.cat([img.to(dtype), text.to(dtype)], dim=1)
            return emb, torch.cat([img_valid, text_valid], dim=1)
        state_ids = discretize_state(batch["state"], self.cfg.num_state_bins) + self.cfg.bin_offset
        state_emb = self.embed(state_ids)
        state_valid = batch.get("state_mask")
        if state_valid is None:
            state_valid = torch.ones_like(state_ids, dtype=torch.bool)
        emb = torch.cat([img.to(dtype), text.to(dtype), state_emb.to(dtype)], dim=1)
        return emb, torch.cat([img_valid, text_valid, state_valid.bool()], dim=1)

    def time_condition(self, t: Tensor) -> Tensor:
        """sincos(t) -> Linear -> swish -> Linear -> swish: the adaRMSNorm condition [B, We]."""
        we = self.cfg.expert.hidden_size
        emb = sincos_period_embedding(t, we, self.cfg.time_min_period, self.cfg.time_max_period)
        emb = ops.silu(self.time_mlp_in(emb.to(self.time_mlp_in.weight.dtype)))
        return ops.silu(self.time_mlp_out(emb))

    def embed_suffix(self, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Noisy actions [B, H, A] and times [B] -> (action tokens [B, H, We], cond [B, We])."""
        w = self.action_in_proj.weight
        return self.action_in_proj(x_t.to(w.dtype)), self.time_condition(t)

    def _velocity_from_suffix(self, suffix_out: Tensor, cond: Tensor) -> Tensor:
        normed, _ = self.expert_norm(suffix_out, cond)
        w = self.action_out_proj.weight
        return self.action_out_proj(normed.to(w.dtype)).float()

    def velocity(self, prefix: Tensor, prefix_valid: Tensor, x_t: Tensor, t: Tensor) -> Tensor:
        """Velocity [B, H, A] from one joint pass (no cache)."""
        suffix, cond = self.embed_suffix(x_t, t)
        _, out = self.joint(prefix, prefix_valid, suffix, cond)
        return self._velocity_from_suffix(out, cond)

    # ---- training and inference ----------------------------------------------------------

    def forward(
        self, batch: dict[str, Tensor], generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """Flow-matching training loss. Returns {"loss", "pred_velocity", "target_velocity"}."""
        self._check(batch, need_action=True)
        prefix, prefix_valid = self.embed_prefix(batch, generator)
        action, mask, x_t, t, target = pi0_training_inputs(
            batch, generator, self.cfg.noise_beta_alpha
        )
        pred = self.velocity(prefix, prefix_valid, x_t, t)
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
        prefix, prefix_valid = self.embed_prefix(batch, generator)
        b = prefix.shape[0]
        shape = (b, self.cfg.action_horizon, self.cfg.action_dim)
        if noise is None:
            noise = randn_like_gen(torch.empty(shape, device=prefix.device), generator)
        cache = self.joint.prefix_cache(prefix, prefix_valid) if use_cache else None

        def velocity(x: Tensor, t: float) -> Tensor:
            tt = torch.full((b,), t, device=x.device)
            if cache is None:
                return self.velocity(prefix, prefix_valid, x, tt)
            suffix, cond = self.embed_suffix(x, tt)
            out = self.joint.suffix_with_cache(suffix, cache, prefix_valid, cond)
            return self._velocity_from_suffix(out, cond)

        steps = num_steps or self.cfg.num_inference_steps
        return euler_integrate(velocity, noise.float(), 1.0, 0.0, steps)

"""FLUX.1 image MMDiT on megatron-core (diffusers' ``FluxTransformer2DModel``).

Latents ``[B, C, T, H, W]`` (``C`` the VAE's 16 channels; images ``T = 1``) -> 2x2 patch tokens
(``(c, dy, dx)`` per token: the FLUX pipelines' packing) -> Linear ``x_embedder``; caption
tokens (T5) -> Linear ``context_embedder``; ``temb`` = MLP(sinusoid(timestep)) + MLP(pooled
text) (+ MLP(sinusoid(guidance)) for guidance-distilled models) -> ``num_layers``
double-stream blocks (image and caption streams, joint attention) -> ``num_single_layers``
single-stream blocks on the joint sequence (``block.py``) -> the image tokens through an AdaLN
(continuous) LayerNorm and a Linear to ``out_channels`` per token -> latents again. The
prediction is the flow-matching velocity ``noise - x0``.

Rotary positions: each token has an id ``(frame, row, column)`` (caption tokens ``(0, 0, 0)``,
FLUX's ``txt_ids``; image tokens their patch's place, FLUX's ``img_ids``); the head's rotary
pairs are split over the three axes by ``axes_dims_rope``.

Call (needs megatron's parallel state, ``longboat.core.megatron.parallel_state``)::

    model(latents, timesteps, text_embeds, text_mask=None, *, pooled_embeds=None,
          guidance=None) -> prediction

``latents`` ``[B, latent_channels, T, H, W]`` (every sample the same size; ``H, W`` even) or a
list of ``[latent_channels, T_i, H_i, W_i]`` (each sample runs alone, the list of predictions
is returned: no packed attention yet); ``timesteps`` ``[B]`` float in ``[0, 1000]``
(``sigma * 1000``; diffusers' forward takes ``sigma`` and multiplies); ``text_embeds``
``[B, L, joint_attention_dim]``; ``text_mask`` ``[B, L]`` bool (True = a caption token) or
None (attend to every caption token, as FLUX's pipelines do with T5 padded to 512);
``pooled_embeds`` ``[B, pooled_projection_dim]`` (CLIP's pooled output) or None: zeros (the
synthetic sets carry no pooled embedding); ``guidance`` ``[B]`` guidance scale (the pipeline's
``guidance_scale``, e.g. 3.5) for ``guidance_embeds`` models, None: ``cfg.guidance_scale``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from longboat.core.layer_kernels import LayerKernels
from longboat.diffusion.models.common.layers import (
    AttentionFn,
    TwoLayerMLP,
    adaln_modulate,
    build_options,
    kernel_attention,
    timestep_embedding,
)
from longboat.diffusion.models.common.patches import (
    grid_angles,
    latent_grid,
    patchify,
    unpatchify,
)
from longboat.diffusion.models.common.recompute import recompute_block
from longboat.diffusion.models.flux.block import (
    JointLayout,
    flux_block_specs,
    flux_transformer_config,
)
from longboat.diffusion.models.flux.config import FluxConfig

_FREQ_DIM = 256  # width of the sinusoidal timestep / guidance embedding (fixed by FLUX)


def rope_tables(
    grid: tuple[int, int, int], text_len: int, cfg: FluxConfig, device: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` / ``sin`` ``[text_len + t*h*w, head_dim // 2]`` of the joint sequence.

    Rotary pair ``i`` of a head turns by the token's frame, row or column id (the first
    ``axes[0] / 2`` pairs by the frame, then rows, then columns) at frequencies
    ``theta ** (-2j / axes[axis])``; caption tokens have id 0 (no rotation).
    """
    image = grid_angles(grid, cfg.axes_dims_rope, float(cfg.rope_theta))
    angles = torch.cat([image.new_zeros(text_len, image.shape[1]), image])
    return angles.cos().float().to(device), angles.sin().float().to(device)


class FluxModel(MegatronModule):
    """The FLUX.1 MMDiT (see the module doc). Build with ``build(cfg)`` or directly."""

    def __init__(
        self,
        cfg: FluxConfig,
        *,
        params_dtype: torch.dtype = torch.float32,
        kernels: LayerKernels | None = None,
        attention_fn: AttentionFn = kernel_attention,
    ) -> None:
        config = flux_transformer_config(cfg, params_dtype=params_dtype)
        super().__init__(config=config)
        self.cfg = cfg
        width, dtype = cfg.hidden_size, params_dtype
        self.x_embedder = torch.nn.Linear(cfg.in_channels, width, dtype=dtype)
        self.context_embedder = torch.nn.Linear(cfg.joint_attention_dim, width, dtype=dtype)
        self.time_embedder = TwoLayerMLP(_FREQ_DIM, width, F.silu, dtype)
        self.guidance_embedder = (
            TwoLayerMLP(_FREQ_DIM, width, F.silu, dtype) if cfg.guidance_embeds else None
        )
        self.pooled_embedder = TwoLayerMLP(cfg.pooled_projection_dim, width, F.silu, dtype)
        double, single = flux_block_specs(kernels, attention_fn)
        self.double_blocks = torch.nn.ModuleList(
            build_module(double, config=config, layer_number=i + 1, eps=cfg.eps)
            for i in range(cfg.num_layers)
        )
        self.single_blocks = torch.nn.ModuleList(
            build_module(single, config=config, layer_number=cfg.num_layers + i + 1, eps=cfg.eps)
            for i in range(cfg.num_single_layers)
        )
        self.norm_out = torch.nn.Linear(width, 2 * width, dtype=dtype)
        self.proj_out = torch.nn.Linear(width, cfg.token_out_channels, dtype=dtype)
        self.recompute_blocks = cfg.recompute_blocks
        """Blocks (from the first double-stream one) whose activations are recomputed in the
        backward; -1: all (``FluxConfig.recompute_blocks``; may be changed between steps)."""
        self.recompute_attention = cfg.recompute_attention
        """Whether recomputed blocks run the attention again (``FluxConfig.recompute_attention``)."""
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # Xavier-uniform linears with zero biases (the blocks' megatron linears get it from
        # the TransformerConfig), N(0, 0.02) embedders, and a zero output head, so training
        # from scratch starts from a constant prediction.
        for linear in (self.x_embedder, self.context_embedder):
            torch.nn.init.xavier_uniform_(linear.weight)
            linear.bias.zero_()
        mlps = [self.time_embedder, self.pooled_embedder]
        mlps += [self.guidance_embedder] if self.guidance_embedder is not None else []
        for mlp in mlps:
            for linear in (mlp.linear_1, mlp.linear_2):
                torch.nn.init.normal_(linear.weight, std=0.02)
                linear.bias.zero_()
        for linear in (self.norm_out, self.proj_out):
            linear.weight.zero_()
            linear.bias.zero_()

    @property
    def dtype(self) -> torch.dtype:
        return self.x_embedder.weight.dtype

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """Every block in order (double-stream, then single-stream)."""
        return [*self.double_blocks, *self.single_blocks]

    def forward(
        self,
        latents: torch.Tensor | Sequence[torch.Tensor],
        timesteps: torch.Tensor,
        text_embeds: torch.Tensor,
        text_mask: torch.Tensor | None = None,
        *,
        pooled_embeds: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Velocity prediction ``[B, out_channels / 4, T, H, W]`` (module doc); for a list of
        latents, the list of predictions (one call per sample)."""
        if not torch.is_tensor(latents):
            return self._forward_list(
                list(latents), timesteps, text_embeds, text_mask, pooled_embeds, guidance
            )
        cfg = self.cfg
        if latents.dim() != 5 or latents.shape[1] != cfg.latent_channels:
            raise ValueError(
                f"latents must be [B, {cfg.latent_channels}, T, H, W], got {tuple(latents.shape)}"
            )
        grid = latent_grid(latents.shape, cfg.latent_patch)
        batch = latents.shape[0]
        timesteps, text_mask, pooled_embeds, guidance = self._check_conditioning(
            batch, timesteps, text_embeds, text_mask, pooled_embeds, guidance
        )
        text_len = text_embeds.shape[1]
        cos, sin = rope_tables(grid, text_len, cfg, latents.device)
        key_mask = None
        if text_mask is not None:
            image = text_mask.new_ones(batch, grid[0] * grid[1] * grid[2])
            key_mask = torch.cat([text_mask, image], dim=1)[:, None, None, :]
        layout = JointLayout(text_len=text_len, cos=cos, sin=sin, key_mask=key_mask)
        tokens = patchify(latents, cfg.latent_patch)
        out = self._run(tokens, timesteps, text_embeds, pooled_embeds, guidance, layout)
        return unpatchify(out, grid, cfg.latent_patch)

    def _forward_list(
        self,
        latents: list[torch.Tensor],
        timesteps: Any,
        text: torch.Tensor,
        mask: torch.Tensor | None,
        pooled: torch.Tensor | None,
        guidance: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        n = len(latents)
        timesteps, mask, pooled, guidance = self._check_conditioning(
            n, timesteps, text, mask, pooled, guidance
        )
        out = []
        for i, x in enumerate(latents):
            if x.dim() != 4:
                raise ValueError(f"sample {i}: latents must be [C, T, H, W], got {tuple(x.shape)}")
            one = slice(i, i + 1)
            m = None if mask is None else mask[one]
            g = None if guidance is None else guidance[one]
            pred = self(
                x[None], timesteps[one], text[one], m, pooled_embeds=pooled[one], guidance=g
            )
            out.append(pred[0])
        return out

    def _check_conditioning(
        self,
        n: int,
        timesteps: Any,
        text: torch.Tensor,
        mask: torch.Tensor | None,
        pooled: torch.Tensor | None,
        guidance: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Shape checks naming the argument; scalars broadcast, defaults filled in."""
        cfg = self.cfg

        def per_sample(value: Any, name: str) -> torch.Tensor:
            if not torch.is_tensor(value):
                value = torch.tensor(value, device=text.device, dtype=torch.float32)
            if value.dim() == 0:
                value = value.expand(n)
            if value.shape != (n,):
                raise ValueError(f"{name} must be [{n}] (one per sample), got {tuple(value.shape)}")
            return value

        timesteps = per_sample(timesteps, "timesteps")
        if text.dim() != 3 or text.shape[0] != n or text.shape[2] != cfg.joint_attention_dim:
            raise ValueError(
                f"text_embeds must be [{n}, L, {cfg.joint_attention_dim}], got {tuple(text.shape)}"
            )
        if mask is not None:
            if mask.shape != text.shape[:2]:
                raise ValueError(
                    f"text_mask must be [{n}, {text.shape[1]}] like text_embeds, got "
                    f"{tuple(mask.shape)}"
                )
            mask = mask.to(torch.bool)
        if pooled is None:
            pooled = text.new_zeros(n, cfg.pooled_projection_dim)
        elif pooled.shape != (n, cfg.pooled_projection_dim):
            raise ValueError(
                f"pooled_embeds must be [{n}, {cfg.pooled_projection_dim}], got "
                f"{tuple(pooled.shape)}"
            )
        if cfg.guidance_embeds:
            guidance = per_sample(cfg.guidance_scale if guidance is None else guidance, "guidance")
        elif guidance is not None:
            raise ValueError(
                "guidance was given but this model has no guidance embedding "
                "(guidance_embeds=False: FLUX.1 [schnell]-style)"
            )
        return timesteps, mask, pooled, guidance

    def _run(
        self,
        tokens: torch.Tensor,
        timesteps: torch.Tensor,
        text: torch.Tensor,
        pooled: torch.Tensor,
        guidance: torch.Tensor | None,
        layout: JointLayout,
    ) -> torch.Tensor:
        """Image tokens ``[B, S, in_channels]`` -> output tokens ``[B, S, out_channels]``."""
        dtype = self.dtype
        x = self.x_embedder(tokens.to(dtype))
        c = self.context_embedder(text.to(dtype))
        temb = self.time_embedder(timestep_embedding(timesteps, _FREQ_DIM).to(dtype))
        if self.guidance_embedder is not None:
            assert guidance is not None
            temb = temb + self.guidance_embedder(
                timestep_embedding(guidance.float() * 1000.0, _FREQ_DIM).to(dtype)
            )
        temb = temb + self.pooled_embedder(pooled.to(dtype))
        vec = F.silu(temb)
        blocks = self.blocks
        recompute = len(blocks) if self.recompute_blocks < 0 else self.recompute_blocks
        n_double = len(self.double_blocks)
        h = None
        for i, block in enumerate(blocks):
            if i == n_double:
                h = torch.cat([c, x], dim=1)
            args = (x, c, vec, layout) if i < n_double else (h, vec, layout)
            if i < recompute and torch.is_grad_enabled():
                out = recompute_block(block, *args, keep_attention=not self.recompute_attention)
            else:
                out = block(*args)
            if i < n_double:
                x, c = out
            else:
                h = out
        if h is not None:
            x = h[:, layout.text_len :]
        scale, shift = self.norm_out(vec).float().chunk(2, dim=-1)
        x = adaln_modulate(x, shift, scale, self.cfg.eps)
        return self.proj_out(x)


def build(
    cfg: FluxConfig,
    *,
    precision: str = "fp32",
    kernels: LayerKernels | None = None,
    attention_fn: AttentionFn = kernel_attention,
) -> FluxModel:
    """A ``FluxModel`` for ``cfg`` on this rank's tensor-parallel shard (megatron's parallel
    state must be initialised), weights in ``precision``; ``kernels`` defaults to
    ``longboat.kernels.layers.longboat_layer_kernels()`` (RMSNorm and RoPE kernels)."""
    params_dtype, kernels = build_options(precision, kernels)
    return FluxModel(cfg, params_dtype=params_dtype, kernels=kernels, attention_fn=attention_fn)

"""Wan 2.1 / 2.2 text-to-video DiT on megatron-core (diffusers' ``WanTransformer3DModel``).

Latent patches -> Linear patch embedding (the ``Conv3d`` with kernel = stride = patch) ->
``num_layers`` ``WanBlock`` s (``block.py``) conditioned on the timestep (sinusoidal
embedding of ``freq_dim`` -> MLP -> ``temb``; ``time_proj(silu(temb))`` gives every block's six
modulation vectors) and on the caption (UMT5 embeddings -> Linear, GELU(tanh), Linear) ->
output LayerNorm modulated by ``temb`` and the head's ``scale_shift_table`` -> Linear to
``out_channels * prod(patch)`` per token -> latents again. The prediction is the flow-matching
velocity ``noise - x0`` (what Wan is trained to output).

Two call forms (both need megatron's parallel state, ``longboat.core.megatron.parallel_state``):

``model(latents, timesteps, text_embeds, text_mask=None) -> prediction``
    ``latents`` ``[B, in_channels, T, H, W]`` (``T, H, W`` multiples of ``patch_size``; every
    sample the same size: a bucketed batch; zero padding would be attended to), ``timesteps``
    ``[B]`` float in ``[0, 1000]`` (diffusers' scale, ``sigma * 1000``), ``text_embeds``
    ``[B, L, text_dim]`` (captions padded to the longest), ``text_mask`` ``[B, L]`` bool
    (True = a caption token) or None; returns ``[B, out_channels, T, H, W]``. ``latents`` may
    also be a list of ``[in_channels, T_i, H_i, W_i]`` of different sizes: they are packed
    into one ``forward_packed`` call and the list of predictions is returned (the packed form
    of ``longboat.diffusion.objective``'s ``ModelFn``).

``model.forward_packed(tokens, packing, timesteps, text_embeds, text_mask=None) -> tokens``
    Samples of different frame counts and resolutions in one sequence. ``tokens``
    ``[S, in_channels * prod(patch)]``: each sample's ``patchify``-ed latents (``packing.py``),
    concatenated in ``packing`` order (``pack_latents`` builds both); ``packing`` a
    ``VideoPacking`` (per-sample grids, ``cu_seqlens`` ``[n + 1]`` int32, ``max_seqlen``);
    ``timesteps`` ``[n]``, ``text_embeds`` ``[n, L, text_dim]``, ``text_mask`` ``[n, L]`` per
    sample. Returns ``[S, out_channels * prod(patch)]`` tokens in the same layout
    (``unpack_tokens`` turns them back into latents; a loss may compare tokens directly with
    ``pack_latents`` of the target). Samples never attend to each other; each sample's rotary
    positions start at 0; each attends only to its own caption.

``text_mask=None`` attends to all ``L`` caption tokens, as Wan's pipeline does with captions
zero-padded to 512; a mask drops the padded tokens, which equals feeding each caption at its
own length.

Context parallelism (megatron's context-parallel group of size ``cp > 1`` when the model is
built): every rank of the group passes the same full inputs and gets the same full output;
inside, each rank runs the blocks on a contiguous ``1 / cp`` slice of the (padded) tokens and
self-attention exchanges slices for head groups (Ulysses, ``longboat.diffusion.parallel``;
``num_attention_heads`` must divide by ``tp * cp``). A parameter's gradient on a rank is the
contribution of that rank's tokens: the sum over the context-parallel group is the full
gradient.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core import parallel_state as mps
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from longboat.core.layer_kernels import LayerKernels
from longboat.diffusion.models.common.layers import (
    AttentionFn,
    TwoLayerMLP,
    adaln_modulate,
    build_options,
    empty_captions,
    gelu_tanh,
    kernel_attention,
    timestep_embedding,
)
from longboat.diffusion.models.common.recompute import recompute_block
from longboat.diffusion.models.wan.block import (
    TokenLayout,
    per_sample,
    wan_block_spec,
    wan_transformer_config,
)
from longboat.diffusion.models.wan.config import WanConfig
from longboat.diffusion.models.wan.packing import (
    VideoPacking,
    latent_grid,
    pack_latents,
    patchify,
    rope_tables,
    unpack_tokens,
    unpatchify,
)
from longboat.diffusion.parallel.ulysses import (
    ContextShard,
    gather_tokens,
    local_segments,
    shard_tokens,
)


class WanModel(MegatronModule):
    """The Wan DiT (see the module doc). Build with ``build(cfg)`` or directly."""

    def __init__(
        self,
        cfg: WanConfig,
        *,
        params_dtype: torch.dtype = torch.float32,
        kernels: LayerKernels | None = None,
        attention_fn: AttentionFn = kernel_attention,
    ) -> None:
        config = wan_transformer_config(cfg, params_dtype=params_dtype)
        super().__init__(config=config)
        self.cfg = cfg
        width, dtype = cfg.hidden_size, params_dtype
        self.patch_embedding = torch.nn.Linear(cfg.patch_dim, width, dtype=dtype)
        self.time_embedder = TwoLayerMLP(cfg.freq_dim, width, F.silu, dtype)
        self.time_proj = torch.nn.Linear(width, 6 * width, dtype=dtype)
        self.text_embedder = TwoLayerMLP(cfg.text_dim, width, gelu_tanh, dtype)
        spec = wan_block_spec(kernels, attention_fn)
        self.blocks = torch.nn.ModuleList(
            build_module(
                spec,
                config=config,
                layer_number=i + 1,
                cross_attn_norm=cfg.cross_attn_norm,
                eps=cfg.eps,
            )
            for i in range(cfg.num_layers)
        )
        self.proj_out = torch.nn.Linear(width, cfg.out_patch_dim, dtype=dtype)
        table = torch.randn(1, 2, width) / math.sqrt(width)
        self.scale_shift_table = torch.nn.Parameter(table)  # fp32 (block.FP32_PARAMETERS)
        self.recompute_blocks = cfg.recompute_blocks
        """Blocks (from the first) whose activations are recomputed in the backward; -1: all
        (``WanConfig.recompute_blocks``; may be changed between steps)."""
        self.recompute_attention = cfg.recompute_attention
        """Whether recomputed blocks run self-attention again (``WanConfig.recompute_attention``)."""
        self.cp_group = None
        """megatron's context-parallel group when its size is > 1 (the tokens of every call
        are sharded over it, see the module doc), else None."""
        if mps.is_initialized() and mps.get_context_parallel_world_size() > 1:
            self.cp_group = mps.get_context_parallel_group()
        self._init_embeddings()

    @torch.no_grad()
    def _init_embeddings(self) -> None:
        # Wan's initialisation: Xavier-uniform linears with zero biases (the blocks' megatron
        # linears get it from the TransformerConfig), N(0, 0.02) time / text embedders, and a
        # zero output projection, so training starts from a constant prediction.
        for linear in (self.patch_embedding, self.time_proj):
            torch.nn.init.xavier_uniform_(linear.weight)
            linear.bias.zero_()
        for mlp in (self.time_embedder, self.text_embedder):
            for linear in (mlp.linear_1, mlp.linear_2):
                torch.nn.init.normal_(linear.weight, std=0.02)
                linear.bias.zero_()
        self.proj_out.weight.zero_()
        self.proj_out.bias.zero_()

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedding.weight.dtype

    # -- public forwards --------------------------------------------------------------------

    def forward(
        self,
        latents: torch.Tensor | Sequence[torch.Tensor],
        timesteps: torch.Tensor,
        text_embeds: torch.Tensor,
        text_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Velocity prediction ``[B, out_channels, T, H, W]`` for same-size ``latents``; for a
        list of ``[C, T_i, H_i, W_i]`` latents, the list of predictions (one packed call)."""
        cfg = self.cfg
        if not torch.is_tensor(latents):
            tokens, packing = pack_latents(list(latents), cfg.patch_size)
            out = self.forward_packed(tokens, packing, timesteps, text_embeds, text_mask)
            return unpack_tokens(out, packing, cfg.patch_size)
        if latents.dim() != 5 or latents.shape[1] != cfg.in_channels:
            raise ValueError(
                f"latents must be [B, {cfg.in_channels}, T, H, W], got {tuple(latents.shape)}"
            )
        grid = latent_grid(latents.shape, cfg.patch_size)
        batch = latents.shape[0]
        timesteps, text_mask = self._check_conditioning(batch, timesteps, text_embeds, text_mask)
        cos, sin = rope_tables([grid], cfg, latents.device)
        layout = TokenLayout(packing=None, cos=cos, sin=sin, text_mask=text_mask)
        out = self._run(patchify(latents, cfg.patch_size), timesteps, text_embeds, layout)
        return unpatchify(out, grid, cfg.patch_size)

    def forward_packed(
        self,
        tokens: torch.Tensor,
        packing: VideoPacking,
        timesteps: torch.Tensor,
        text_embeds: torch.Tensor,
        text_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Velocity tokens ``[S, out_channels * prod(patch)]`` of packed samples."""
        cfg = self.cfg
        if tokens.dim() != 2 or tokens.shape != (packing.total, cfg.patch_dim):
            raise ValueError(
                f"packed tokens must be [{packing.total}, {cfg.patch_dim}] (the packing's "
                f"tokens x in_channels * prod(patch_size)), got {tuple(tokens.shape)}"
            )
        n = packing.num_samples
        timesteps, text_mask = self._check_conditioning(n, timesteps, text_embeds, text_mask)
        cos, sin = rope_tables(packing.grids, cfg, tokens.device)
        layout = TokenLayout(
            packing=packing.to(tokens.device), cos=cos, sin=sin, text_mask=text_mask
        )
        return self._run(tokens.unsqueeze(0), timesteps, text_embeds, layout)[0]

    # -- internals --------------------------------------------------------------------------

    def _check_conditioning(
        self, n: int, timesteps: Any, text: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shape checks with messages that name the argument; a scalar timestep is broadcast."""
        if not torch.is_tensor(timesteps):
            timesteps = torch.tensor(timesteps, device=text.device)
        if timesteps.dim() == 0:
            timesteps = timesteps.expand(n)
        if timesteps.shape != (n,):
            raise ValueError(
                f"timesteps must be [{n}] (one per sample; per-token timesteps are not "
                f"supported), got {tuple(timesteps.shape)}"
            )
        if text.dim() != 3 or text.shape[0] != n or text.shape[2] != self.cfg.text_dim:
            raise ValueError(
                f"text_embeds must be [{n}, L, {self.cfg.text_dim}], got {tuple(text.shape)}"
            )
        if mask is not None:
            if mask.shape != text.shape[:2]:
                raise ValueError(
                    f"text_mask must be [{n}, {text.shape[1]}] like text_embeds, got "
                    f"{tuple(mask.shape)}"
                )
            mask = mask.to(torch.bool)
            # Reading a device mask back would stall the step: the training step checks its
            # batch on the host (train.step.model_inputs) before the copy.
            if mask.device.type == "cpu":
                empty = empty_captions(mask)
                if empty:
                    raise ValueError(f"text_mask has no caption token for samples {empty}")
        return timesteps, mask

    def _run(
        self,
        tokens: torch.Tensor,
        timesteps: torch.Tensor,
        text_embeds: torch.Tensor,
        layout: TokenLayout,
    ) -> torch.Tensor:
        """Tokens ``[B, S, patch_dim]`` -> output tokens ``[B, S, out_patch_dim]``."""
        width = self.cfg.hidden_size
        shard = None
        if self.cp_group is not None:
            shard = ContextShard.of(tokens.shape[1], self.cp_group)
            tokens = shard_tokens(tokens, shard)
            segments = None
            if layout.packing is not None:
                segments = local_segments(layout.packing.seqlens, shard)
            layout = dataclasses.replace(
                layout,
                cos=shard_tokens(layout.cos, shard, dim=0),
                sin=shard_tokens(layout.sin, shard, dim=0),
                shard=shard,
                segments=segments,
            )
        x = self.patch_embedding(tokens.to(self.dtype))
        freq = timestep_embedding(timesteps, self.cfg.freq_dim)
        temb = self.time_embedder(freq.to(self.dtype))  # [n, D]
        time_proj = self.time_proj(F.silu(temb)).unflatten(1, (6, width))  # [n, 6, D]
        text = self.text_embedder(text_embeds.to(self.dtype))  # [n, L, D]
        recompute = len(self.blocks) if self.recompute_blocks < 0 else self.recompute_blocks
        for i, block in enumerate(self.blocks):
            if i < recompute and torch.is_grad_enabled():
                x = recompute_block(
                    block, x, text, time_proj, layout, keep_attention=not self.recompute_attention
                )
            else:
                x = block(x, text, time_proj, layout)
        shift, scale = (self.scale_shift_table.float() + temb.float()[:, None]).unbind(1)
        eps = self.cfg.eps
        x = per_sample(lambda t, a, b: adaln_modulate(t, a, b, eps), (x,), (shift, scale), layout)
        out = self.proj_out(x)
        return out if shard is None else gather_tokens(out, shard)


def build(
    cfg: WanConfig,
    *,
    precision: str = "fp32",
    kernels: LayerKernels | None = None,
    attention_fn: AttentionFn = kernel_attention,
) -> WanModel:
    """A ``WanModel`` for ``cfg`` on this rank's tensor-parallel shard (megatron's parallel
    state must be initialised), weights in ``precision``; ``kernels`` defaults to
    ``longboat.kernels.layers.longboat_layer_kernels()`` (RMSNorm and RoPE kernels)."""
    params_dtype, kernels = build_options(precision, kernels)
    return WanModel(cfg, params_dtype=params_dtype, kernels=kernels, attention_fn=attention_fn)


__all__ = ["TwoLayerMLP", "WanModel", "build", "timestep_embedding"]

"""Qwen3-VL vision tower on megatron-core layers.

Flattened patches ``[N, C*T*p*p]`` -> patch embedding (HF's Conv3d as a Linear with a bias)
+ the learned position table resampled bilinearly (corners aligned) to each image's patch
grid -> ``depth`` pre-LayerNorm blocks (multi-head attention with the 2D axial rotary
embedding, every frame attending to itself only; a GELU MLP; every linear with a bias) ->
the patch merger (LayerNorm per patch, ``spatial_merge_size**2`` patches concatenated,
Linear -> GELU -> Linear) -> ``[N / merge_unit, out_hidden_size]``. The outputs of the blocks
in ``deepstack_visual_indexes`` go through their own mergers (the LayerNorm after the
concatenation) into the deepstack features the decoder adds to its first layers' outputs.

The blocks are megatron ``TransformerLayer`` s from the SigLIP tower's spec (LayerNorms,
bidirectional varlen attention through ``longboat.kernels``, a plain MLP), so tensor
parallelism is megatron's; the mergers are column / row parallel like the blocks' MLPs, the
patch and position embeddings and the norms are replicated. The frames are packed into one
sequence (``qkv_format="sbhd"``, one ``cu_seqlens`` segment per frame), in the processor's
merge-block-major patch order, which the mergers rely on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from longboat.core.megatron.specs import LayerKernels
from longboat.vlm.models.qwen2_5_vl.vision import (
    frame_cu_seqlens,
    rotary_freqs,
    vision_position_ids,
)
from longboat.vlm.models.qwen3_vl.vision_config import Qwen3VisionConfig
from longboat.vlm.models.siglip.model import siglip_layer_spec
from longboat.vlm.models.vit_config import gelu_activation, vit_transformer_config


def vision_transformer_config(
    cfg: Qwen3VisionConfig,
    *,
    tensor_parallel: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Any:
    """megatron ``TransformerConfig`` of the tower's blocks (``tensor_parallel`` defaults to
    the live megatron TP size)."""
    from megatron.core import parallel_state as mps

    cfg.validate()
    return vit_transformer_config(
        num_layers=cfg.depth,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        normalization="LayerNorm",
        norm_eps=cfg.norm_eps,
        gated=False,
        activation_func=gelu_activation(cfg.hidden_act),
        tensor_parallel=tensor_parallel or mps.get_tensor_model_parallel_world_size(),
        params_dtype=params_dtype,
        **overrides,
    )


class PatchMerger(MegatronModule):
    """``merge_unit`` patches -> one token: LayerNorm, concatenate, Linear -> GELU -> Linear.

    ``postshuffle_norm`` (the deepstack mergers): the LayerNorm runs over the concatenated
    patches instead of over each patch.
    """

    def __init__(
        self, config: Any, cfg: Qwen3VisionConfig, *, postshuffle_norm: bool, tp_group: Any = None
    ) -> None:
        super().__init__(config=config)
        width = cfg.hidden_size * cfg.merge_unit
        self.width = width
        self.postshuffle_norm = postshuffle_norm
        self.norm = torch.nn.LayerNorm(
            width if postshuffle_norm else cfg.hidden_size, eps=cfg.norm_eps,
            dtype=config.params_dtype,
        )  # fmt: skip
        self.linear_fc1 = ColumnParallelLinear(
            width, width, config=config, init_method=config.init_method, bias=True,
            gather_output=False, skip_bias_add=False, tp_group=tp_group,
        )  # fmt: skip
        self.linear_fc2 = RowParallelLinear(
            width, cfg.out_hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=True, input_is_parallel=True, skip_bias_add=False, tp_group=tp_group,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` (merge groups contiguous) -> ``[N / merge_unit, out_hidden_size]``."""
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.width))
        else:
            x = self.norm(x).reshape(-1, self.width)
        x, _ = self.linear_fc1(x)
        x, _ = self.linear_fc2(F.gelu(x))
        return x


class Qwen3VisionMergers(MegatronModule):
    """The final patch merger and the deepstack mergers: together what ``model.freeze``
    calls the projector."""

    def __init__(self, config: Any, cfg: Qwen3VisionConfig, tp_group: Any = None) -> None:
        super().__init__(config=config)
        self.patch = PatchMerger(config, cfg, postshuffle_norm=False, tp_group=tp_group)
        self.deepstack = torch.nn.ModuleList(
            PatchMerger(config, cfg, postshuffle_norm=True, tp_group=tp_group)
            for _ in cfg.deepstack_visual_indexes
        )


def _run_layer(layer: Any, x: torch.Tensor, freqs: torch.Tensor, params: Any) -> torch.Tensor:
    out, _ = layer(x, attention_mask=None, rotary_pos_emb=freqs, packed_seq_params=params)
    return out


def _frame_packing(grid_thw: torch.Tensor, device: torch.device) -> PackedSeqParams:
    cu = frame_cu_seqlens(grid_thw)
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    cu = cu.to(device)
    return PackedSeqParams(
        qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )  # fmt: skip


class Qwen3VisionModel(MegatronModule):
    """The Qwen3-VL ViT: ``forward(pixel_values, grid_thw) -> (merged tokens, deepstack
    features)``, both ``[sum(t*h*w) / merge_unit, out_hidden_size]`` in input order.

    Needs megatron's parallel state (``longboat.core.megatron.parallel_state.initialize``).
    ``pg_collection``: megatron process groups of the tower's layers (default: the live
    ones); its ``tp`` sets the tower's tensor-parallel size.
    """

    def __init__(
        self,
        cfg: Qwen3VisionConfig,
        *,
        params_dtype: torch.dtype = torch.float32,
        kernels: LayerKernels | None = None,
        pg_collection: Any = None,
    ) -> None:
        tp_group = pg_collection.tp if pg_collection is not None else None
        config = vision_transformer_config(
            cfg,
            tensor_parallel=tp_group.size() if tp_group is not None else None,
            params_dtype=params_dtype,
        )
        super().__init__(config=config)
        self.cfg = cfg
        self.patch_embed = torch.nn.Linear(
            cfg.patch_dim, cfg.hidden_size, bias=True, dtype=params_dtype
        )
        self.position_embedding = torch.nn.Parameter(
            torch.randn(cfg.num_position_embeddings, cfg.hidden_size, dtype=params_dtype) * 0.02
        )
        spec = siglip_layer_spec(kernels)
        groups = {} if pg_collection is None else {"pg_collection": pg_collection}
        self.layers = torch.nn.ModuleList(
            build_module(spec, config=config, layer_number=i + 1, **groups)
            for i in range(cfg.depth)
        )
        self.merger = Qwen3VisionMergers(config, cfg, tp_group=tp_group)
        self.recompute = False
        """Recompute each block's activations in the backward instead of keeping them."""

    def position_embeddings(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[sum(t*h*w), hidden]``: the learned table resampled to each grid (bilinear,
        corners aligned), in the processor's merge-block-major patch order, per frame."""
        cfg, m = self.cfg, self.cfg.spatial_merge_size
        side = cfg.position_grid
        table = self.position_embedding.float().reshape(side, side, -1).permute(2, 0, 1)[None]
        resized: dict[tuple[int, int], torch.Tensor] = {}
        out = []
        for t, h, w in grid_thw.tolist():
            if (h, w) not in resized:
                grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
                grid = grid.permute(1, 2, 0).reshape(h // m, m, w // m, m, -1).transpose(1, 2)
                resized[(h, w)] = grid.reshape(h * w, -1)
            out.append(resized[(h, w)].repeat(t, 1))
        return torch.cat(out).to(self.position_embedding.dtype)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(merged, deepstack)``: the merged vision tokens and one feature tensor of the same
        shape per deepstack block, in block order (the decoder layer each one feeds).

        ``pixel_values`` ``[sum(t*h*w), patch_dim]`` as the processor lays them out;
        ``grid_thw`` ``[n, 3]`` (t, h, w in patches; h and w multiples of the merge size).
        """
        cfg = self.cfg
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(
                f"pixel_values must be [patches, {cfg.patch_dim}], got {tuple(pixel_values.shape)}"
            )
        grid_thw = grid_thw.cpu()
        if bool((grid_thw[:, 1:] % cfg.spatial_merge_size).any()):
            raise ValueError(
                f"grid_thw {grid_thw.tolist()}: heights and widths must be multiples of "
                f"spatial_merge_size={cfg.spatial_merge_size}"
            )
        total = int(grid_thw.prod(-1).sum())
        if pixel_values.shape[0] != total:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patches but grid_thw describes {total}"
            )
        device = pixel_values.device
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        x = (x + self.position_embeddings(grid_thw).to(device)).unsqueeze(1)  # [s, b=1, h]
        positions = vision_position_ids(grid_thw, cfg.spatial_merge_size).to(device)
        freqs = rotary_freqs(positions, cfg)
        params = _frame_packing(grid_thw, device)
        which = {block: k for k, block in enumerate(cfg.deepstack_visual_indexes)}
        deepstack = []
        for i, layer in enumerate(self.layers):
            if self.recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    _run_layer, layer, x, freqs, params, use_reentrant=False
                )
            else:
                x = _run_layer(layer, x, freqs, params)
            if i in which:
                deepstack.append(self.merger.deepstack[which[i]](x.squeeze(1)))
        return self.merger.patch(x.squeeze(1)), deepstack

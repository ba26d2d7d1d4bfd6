"""Qwen2.5-VL vision tower on megatron-core layers.

Flattened patches ``[N, C*T*p*p]`` -> patch embedding -> ``depth`` pre-norm blocks (RMSNorm,
multi-head attention with a 2D axial rotary embedding, RMSNorm, SwiGLU MLP; every linear
with a bias) -> patch merger (RMSNorm, ``spatial_merge_size**2`` patches concatenated, MLP
with GELU) -> ``[N / merge_unit, out_hidden_size]`` in the input's token order.

The blocks are megatron ``TransformerLayer`` s (``SelfAttention`` with column / row parallel
linears, megatron's gated MLP with ``add_bias_linear``), so tensor parallelism is megatron's.
Attention is varlen over packed windows: blocks listed in ``fullatt_block_indexes`` attend
within each frame, the others within windows of ``window_size`` pixels. megatron's
``TransformerBlock`` hands one ``PackedSeqParams`` to every layer, so the tower calls its
layers one by one, each with the packing its kind needs. The tokens are permuted once into
window order (frames stay contiguous, so the per-frame boundaries stay valid for the full
attention blocks) and put back in the merger's output.

The ``PackedSeqParams`` carry ``qkv_format="sbhd"``: megatron then rotates q / k with the one
per-token frequency table in one op (its ``thd`` path would split the table per window in
Python for every layer), and ``VarlenCoreAttention`` reads ``cu_seqlens_q`` itself, passing
the packed tokens to ``longboat.kernels.attention`` (flash-attn varlen / cuDNN on GPU, SDPA
with a document mask on CPU). The layer spec is longboat's (norms, linears and activation
from core's ``LongboatSpecProvider``); the Transformer Engine spec is not offered here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from longboat.core.megatron.specs import (
    KernelCoreAttention,
    KernelRMSNorm,
    LayerKernels,
    LongboatSpecProvider,
)
from longboat.vlm.models.qwen2_5_vl.vision_config import Qwen25VisionConfig
from longboat.vlm.models.vit_config import vit_transformer_config

VarlenAttentionFn = Callable[..., torch.Tensor]
"""``fn(q, k, v, *, causal, cu_seqlens, max_seqlen, scale)`` on packed ``[tokens, heads, dim]``
tensors, tokens attending only inside their ``cu_seqlens`` segment (``longboat.kernels``'
``attention`` contract)."""


def kernel_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    scale: float,
) -> torch.Tensor:
    """Packed varlen attention through ``longboat.kernels.attention``'s dispatch."""
    from longboat.kernels.attention import attention

    return attention(
        q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scale=scale
    )


# -- geometry ------------------------------------------------------------------------------


def _grids(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def frame_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """``[frames + 1]`` int32 offsets of every frame of every image / video (full attention)."""
    lengths = [h * w for t, h, w in _grids(grid_thw) for _ in range(t)]
    return F.pad(torch.tensor(lengths, dtype=torch.int64).cumsum(0), (1, 0)).to(torch.int32)


def vision_position_ids(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """``[N, 2]`` (row, column) patch coordinates in the processor's merge-block-major order."""
    out = []
    for t, h, w in _grids(grid_thw):
        rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
        cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
        frame = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1)
        out.append(frame.repeat(t, 1))
    return torch.cat(out)


def window_partition(
    grid_thw: torch.Tensor, cfg: Qwen25VisionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged-token order grouped by attention window, and the windows' patch offsets.

    Returns ``(window_index, cu_window_seqlens)``: ``window_index[j]`` is the merged token
    placed at position ``j`` (windows row by row, frame by frame); ``cu_window_seqlens`` are the
    int32 offsets of the windows in patches (``merge_unit`` patches per merged token).
    """
    side, unit = cfg.window_merged, cfg.merge_unit
    merge = cfg.spatial_merge_size
    order: list[torch.Tensor] = []
    sizes: list[torch.Tensor] = []
    base = 0
    for t, h, w in _grids(grid_thw):
        gh, gw = h // merge, w // merge
        nh, nw = -(-gh // side), -(-gw // side)
        ids = torch.arange(t * gh * gw).view(t, gh, gw)
        ids = F.pad(ids, (0, nw * side - gw, 0, nh * side - gh), value=-1)
        ids = ids.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        keep = ids >= 0
        order.append(ids[keep] + base)
        sizes.append(keep.sum(1))
        base += t * gh * gw
    cu = F.pad(torch.cat(sizes).cumsum(0) * unit, (1, 0))
    return torch.cat(order), cu.to(torch.int32)


@dataclass(frozen=True)
class VisionPacking:
    """Everything the tower derives from ``grid_thw``: token order, rotary positions, packing.

    Built once per batch (``VisionPacking.build``); the data pipeline may build it ahead.
    """

    token_order: torch.Tensor
    """``[N]`` patch permutation into window order."""
    merged_inverse: torch.Tensor
    """``[N / merge_unit]`` permutation back from window order to input order (merged)."""
    positions: torch.Tensor
    """``[N, 2]`` (row, column) of each patch, in window order."""
    full: PackedSeqParams
    """Packing of the full-attention blocks (one segment per frame)."""
    window: PackedSeqParams
    """Packing of the window-attention blocks (one segment per window)."""

    @classmethod
    def build(cls, grid_thw: torch.Tensor, cfg: Qwen25VisionConfig) -> VisionPacking:
        """The packing of images / videos of ``grid_thw`` ``[n, 3]`` (t, h, w in patches)."""
        grid_thw = grid_thw.cpu()
        unit = cfg.merge_unit
        window_index, cu_window = window_partition(grid_thw, cfg)
        order = (window_index[:, None] * unit + torch.arange(unit)).reshape(-1)
        positions = vision_position_ids(grid_thw, cfg.spatial_merge_size)[order]
        return cls(
            token_order=order,
            merged_inverse=torch.argsort(window_index),
            positions=positions,
            full=_packed(frame_cu_seqlens(grid_thw)),
            window=_packed(cu_window),
        )

    def to(self, device: torch.device | str) -> VisionPacking:
        """A copy on ``device``."""

        def move(p: PackedSeqParams) -> PackedSeqParams:
            return _packed(p.cu_seqlens_q.to(device), p.max_seqlen_q)

        return VisionPacking(
            token_order=self.token_order.to(device),
            merged_inverse=self.merged_inverse.to(device),
            positions=self.positions.to(device),
            full=move(self.full),
            window=move(self.window),
        )


def _packed(cu: torch.Tensor, max_len: int | None = None) -> PackedSeqParams:
    if max_len is None:
        max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return PackedSeqParams(
        qkv_format="sbhd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


def rotary_freqs(positions: torch.Tensor, cfg: Qwen25VisionConfig) -> torch.Tensor:
    """megatron's ``[N, 1, 1, head_dim]`` angle table of the 2D axial rotary embedding.

    A quarter of the head's frequencies rotate by the row, a quarter by the column; the
    half-split rotation pairs channel ``i`` with ``i + head_dim / 2``.
    """
    half = cfg.head_dim // 2
    inv_freq = 1.0 / cfg.rope_theta ** (
        torch.arange(0, half, 2, dtype=torch.float32, device=positions.device) / half
    )
    angles = positions.float()[..., None] * inv_freq  # [N, 2, head_dim / 4]
    angles = angles.flatten(1)  # rows' angles, then columns'
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


# -- megatron modules ----------------------------------------------------------------------


class VarlenCoreAttention(KernelCoreAttention):
    """megatron ``core_attention`` over packed segments (``packed_seq_params.cu_seqlens_q``):
    core's ``KernelCoreAttention`` with a varlen kernel (``attention_fn`` from the spec).

    Takes megatron's ``[s, 1, heads, d]`` q / k / v (sbhd, batch 1) and returns
    ``[s, 1, heads * d]``; without ``packed_seq_params`` all tokens attend to each other.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise NotImplementedError("the vision tower packs segments; it takes no mask or bias")
        if query.dim() != 4 or query.shape[1] != 1:
            raise ValueError(f"expected sbhd q with batch 1, got {tuple(query.shape)}")
        s = query.shape[0]
        if packed_seq_params is None:
            cu = torch.tensor([0, s], dtype=torch.int32, device=query.device)
            max_len = s
        else:
            cu, max_len = packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q
        q, k, v = (t.squeeze(1) for t in (query, key, value))
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        out = self.attention_fn(
            q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=max_len,
            scale=self.softmax_scale,
        )  # fmt: skip
        return out.reshape(s, 1, -1)


def vision_layer_spec(
    kernels: LayerKernels | None = None,
    attention_fn: VarlenAttentionFn = kernel_varlen_attention,
) -> ModuleSpec:
    """``TransformerLayer`` spec of a ViT block: bidirectional varlen attention, RMSNorms,
    SwiGLU MLP (biases come from ``add_bias_linear`` in the TransformerConfig)."""
    kernels = kernels or LayerKernels()
    provider = LongboatSpecProvider(kernels)
    norm = provider.layer_norm(rms_norm=True)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=provider.column_parallel_linear(),
                    core_attention=ModuleSpec(
                        module=VarlenCoreAttention, params={"attention_fn": attention_fn}
                    ),
                    linear_proj=provider.row_parallel_linear(),
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=get_mlp_module_spec_for_backend(
                backend=provider,
                num_experts=None,
                moe_grouped_gemm=False,
                use_te_activation_func=kernels.swiglu is not None,
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def vision_transformer_config(
    cfg: Qwen25VisionConfig,
    *,
    tensor_parallel: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    kernel_activation: bool = False,
    **overrides: Any,
) -> Any:
    """megatron ``TransformerConfig`` of the tower's blocks (``tensor_parallel`` defaults to
    the live megatron TP size)."""
    from megatron.core import parallel_state as mps

    cfg.validate()
    if tensor_parallel is None:
        tensor_parallel = mps.get_tensor_model_parallel_world_size()
    return vit_transformer_config(
        num_layers=cfg.depth,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        normalization="RMSNorm",
        norm_eps=cfg.norm_eps,
        gated=True,
        activation_func=F.silu,
        tensor_parallel=tensor_parallel,
        params_dtype=params_dtype,
        **{"use_te_activation_func": kernel_activation, **overrides},
    )


class PatchMerger(MegatronModule):
    """RMSNorm per patch, ``merge_unit`` patches concatenated, Linear -> GELU -> Linear."""

    def __init__(
        self, config: Any, cfg: Qwen25VisionConfig, kernels: LayerKernels, tp_group: Any = None
    ) -> None:
        super().__init__(config=config)
        width = cfg.hidden_size * cfg.merge_unit
        self.width = width
        self.norm = KernelRMSNorm(config, cfg.hidden_size, cfg.norm_eps, rms_norm=kernels.rms_norm)
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
        x = self.norm(x).reshape(-1, self.width)
        x, _ = self.linear_fc1(x)
        x, _ = self.linear_fc2(F.gelu(x))
        return x


def _run_layer(layer: Any, x: torch.Tensor, freqs: torch.Tensor, params: Any) -> torch.Tensor:
    out, _ = layer(x, attention_mask=None, rotary_pos_emb=freqs, packed_seq_params=params)
    return out


class Qwen25VisionModel(MegatronModule):
    """The Qwen2.5-VL ViT: ``forward(pixel_values, grid_thw) -> [merged tokens, out_hidden]``.

    Needs megatron's parallel state (``longboat.core.megatron.parallel_state.initialize``).
    ``pg_collection``: megatron process groups of the tower's layers (default: the live
    ones); its ``tp`` sets the tower's tensor-parallel size.
    """

    def __init__(
        self,
        cfg: Qwen25VisionConfig,
        *,
        params_dtype: torch.dtype = torch.float32,
        kernels: LayerKernels | None = None,
        attention_fn: VarlenAttentionFn = kernel_varlen_attention,
        pg_collection: Any = None,
    ) -> None:
        kernels = kernels or LayerKernels()
        tp_group = pg_collection.tp if pg_collection is not None else None
        config = vision_transformer_config(
            cfg,
            tensor_parallel=tp_group.size() if tp_group is not None else None,
            params_dtype=params_dtype,
            kernel_activation=kernels.swiglu is not None,
        )
        super().__init__(config=config)
        self.cfg = cfg
        self.patch_embed = torch.nn.Linear(
            cfg.patch_dim, cfg.hidden_size, bias=False, dtype=params_dtype
        )
        spec = vision_layer_spec(kernels, attention_fn)
        groups = {} if pg_collection is None else {"pg_collection": pg_collection}
        self.layers = torch.nn.ModuleList(
            build_module(spec, config=config, layer_number=i + 1, **groups)
            for i in range(cfg.depth)
        )
        self.merger = PatchMerger(config, cfg, kernels, tp_group=tp_group)
        self._full = frozenset(cfg.fullatt_block_indexes)
        self.recompute = False
        """Recompute each block's activations in the backward instead of keeping them."""

    def forward(
        self,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        packing: VisionPacking | None = None,
    ) -> torch.Tensor:
        """Merged vision tokens ``[sum(t*h*w) / merge_unit, out_hidden_size]`` in input order.

        ``pixel_values`` ``[sum(t*h*w), patch_dim]`` as the processor lays them out;
        ``grid_thw`` ``[n, 3]``; ``packing`` (built from ``grid_thw`` when None).
        """
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.cfg.patch_dim:
            raise ValueError(
                f"pixel_values must be [patches, {self.cfg.patch_dim}], got "
                f"{tuple(pixel_values.shape)}"
            )
        if packing is None:
            packing = VisionPacking.build(grid_thw, self.cfg).to(pixel_values.device)
        total = int(packing.token_order.numel())
        if pixel_values.shape[0] != total:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patches but grid_thw describes {total}"
            )
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        x = x[packing.token_order].unsqueeze(1)  # [s, b=1, hidden]
        freqs = rotary_freqs(packing.positions, self.cfg)
        for i, layer in enumerate(self.layers):
            params = packing.full if i in self._full else packing.window
            if self.recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    _run_layer, layer, x, freqs, params, use_reentrant=False
                )
            else:
                x = _run_layer(layer, x, freqs, params)
        merged = self.merger(x.squeeze(1))
        return merged[packing.merged_inverse]

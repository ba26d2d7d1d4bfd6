"""DeepSeek-V3 on megatron-core: the ``MLATransformerConfig``, the layer specs and the model
chunks of this rank.

Attention is megatron's ``MLASelfAttention`` (low-rank q and kv, the decoupled rotary key,
YaRN through ``YarnRotaryEmbedding``); the MLP of the first ``first_k_dense`` layers is a
dense SwiGLU and of the others megatron's ``MoELayer`` with shared experts and the top-k
router configured as DeepSeek-V3's (sigmoid scores, the expert bias of aux-loss-free
balancing updated after every step by megatron's ``finalize_model_grads``, group-limited
top-k, the routed scaling factor, the sequence-wise auxiliary loss), its routed experts
grouped or megatron's ``SequentialMLP`` (``moe_experts``). Multi-token prediction is
megatron's ``MultiTokenPredictionBlock`` on the last pipeline stage. On the longboat
backend (also what ``auto`` means here) the norms, linears, SwiGLU and attention are
longboat's kernels (core's layer spec with its attention swapped for MLA); ``te`` uses
megatron's Transformer Engine MLA spec.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from longboat.llm.models.deepseek_v3.config import DeepseekV3Config


def transformer_config(cfg: DeepseekV3Config, *, backend: str = "longboat", **kwargs: Any) -> Any:
    """megatron ``MLATransformerConfig`` of ``cfg``: core's ``to_transformer_config`` (layout,
    precision, unfused kernels; ``kwargs`` as there) with MLA, DeepSeekMoE and MTP fields."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    from longboat.core.megatron.decoder_config import to_transformer_config

    cfg.validate()
    dense = cfg.first_k_dense
    moe: dict[str, Any] = dict(
        moe_layer_freq=[0] * dense + [1] * (cfg.num_layers - dense),
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
        moe_router_topk_scaling_factor=cfg.moe_routed_scaling_factor,
        moe_router_load_balancing_type="seq_aux_loss" if cfg.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_shared_expert_intermediate_size=(
            cfg.num_shared_experts * int(cfg.moe_ffn_hidden_size or 0)
            if cfg.num_shared_experts
            else None
        ),
        moe_shared_expert_overlap=False,
    )
    if cfg.moe_router_num_groups > 1:
        moe.update(
            moe_router_num_groups=cfg.moe_router_num_groups,
            moe_router_group_topk=cfg.moe_router_group_topk,
        )
    if cfg.mtp_num_layers:
        moe.update(
            mtp_num_layers=cfg.mtp_num_layers,
            mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
        )
    moe.update(kwargs.pop("overrides", {}))
    base = to_transformer_config(cfg, **kwargs, **moe)
    values = {
        f.name: getattr(base, f.name) for f in dataclasses.fields(TransformerConfig) if f.init
    }
    yarn = cfg.yarn_factor is not None
    values.update(
        multi_latent_attention=True,
        qk_layernorm=True,  # megatron builds MLA's q / kv latent norms only with it
        transformer_impl="transformer_engine" if backend == "te" else "local",
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_base=cfg.rope_theta,
        rotary_percent=1.0,
        rotary_scaling_factor=cfg.yarn_factor or 1.0,
        original_max_position_embeddings=cfg.yarn_original_max_position_embeddings,
        beta_fast=cfg.yarn_beta_fast,
        beta_slow=cfg.yarn_beta_slow,
        mscale=cfg.yarn_mscale,
        mscale_all_dim=cfg.yarn_mscale_all_dim if yarn else 0.0,
    )
    if cfg.index_topk is not None:
        values.update(
            experimental_attention_variant="dsa",
            dsa_indexer_n_heads=cfg.index_n_heads,
            dsa_indexer_head_dim=cfg.index_head_dim,
            dsa_indexer_topk=cfg.index_topk,
            dsa_indexer_loss_coeff=cfg.index_loss_coeff,
            # DeepSeek-V3.2's released indexer: half-split rotary, ReLU scores, the key's
            # LayerNorm at 1e-6. Its Hadamard rotation of q and k leaves q . k unchanged (an
            # orthogonal map on both), so it is skipped, as transformers does.
            dsa_indexer_rope_interleaved=False,
            dsa_indexer_rotate_activation=False,
            dsa_indexer_scoring_relu=True,
            dsa_indexer_k_norm_epsilon=1e-6,
        )
    return MLATransformerConfig(**values)


class DuplicatedLinear(torch.nn.Linear):
    """A linear every tensor-parallel rank holds whole (the lightning indexer's projections),
    returning megatron's ``(output, bias)`` pair."""

    def __init__(self, in_features: int, out_features: int, *, config: Any, init_method: Any,
                 bias: bool, **_: Any) -> None:  # fmt: skip
        super().__init__(in_features, out_features, bias=bias, dtype=config.params_dtype)
        with torch.no_grad():
            init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


class IndexerKeyNorm(torch.nn.LayerNorm):
    """The lightning indexer's key LayerNorm (built as megatron builds its torch norms:
    ``norm(config=, hidden_size=, eps=)``, weights in fp32), computed in fp32 and returned in
    the key's dtype: CUDA's layer_norm takes no bf16 input with fp32 weights."""

    def __init__(self, *, config: Any, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        w, b = self.weight, self.bias
        out = torch.nn.functional.layer_norm(
            x.float(), self.normalized_shape, w.float(), b.float(), self.eps
        )
        return out.to(x.dtype)


class LatentCoreAttention(torch.nn.Module):
    """Core attention of MLA on an injected kernel: the value head (``v_head_dim``) may be
    narrower than the query/key head; the kernel takes equal widths, so the values are
    zero-padded to the key width and the output cut back (exact: the pad columns of the
    output are zero and dropped)."""

    def __init__(self, config: Any, *args: Any, attention_fn: Any, **kwargs: Any) -> None:
        super().__init__()
        from longboat.core.megatron.specs import KernelCoreAttention

        kwargs.pop("k_channels", None)
        kwargs.pop("v_channels", None)
        self.inner = KernelCoreAttention(config, *args, attention_fn=attention_fn, **kwargs)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        width = value.shape[-1]
        if width != key.shape[-1]:
            value = torch.nn.functional.pad(value, (0, key.shape[-1] - width))
        out = self.inner(query, key, value, attention_mask, **kwargs)
        if width == key.shape[-1]:
            return out
        sq, b, heads = query.shape[0], query.shape[1], query.shape[2]
        return out.view(sq, b, heads, -1)[..., :width].reshape(sq, b, heads * width)


LATENT_NORM_EPS = 1e-6
"""The epsilon of MLA's q / kv latent RMSNorms. DeepSeek-V3's own code and transformers'
``DeepseekV3Attention`` build them with the norm's default 1e-6 whatever ``rms_norm_eps``
says (Moonlight's is 1e-5: its layer norms use that, its latent norms 1e-6)."""


class _LatentNorm(torch.nn.Module):
    """Factory MLA calls as ``norm(hidden_size=, config=, eps=)`` for its q / kv latent norms:
    megatron passes the layers' ``layernorm_epsilon``, the latent norms take
    ``LATENT_NORM_EPS``."""

    def __new__(cls, *, hidden_size: int, config: Any, eps: float, rms_norm: Any) -> Any:
        from longboat.core.megatron.specs import KernelRMSNorm

        return KernelRMSNorm(config, hidden_size, LATENT_NORM_EPS, rms_norm=rms_norm)


class _LocalLatentNorm(torch.nn.Module):
    """``_LatentNorm`` over megatron's own norm class ``norm`` (the ``local`` backend)."""

    def __new__(cls, *, hidden_size: int, config: Any, eps: float, norm: Any) -> Any:
        return norm(config=config, hidden_size=hidden_size, eps=LATENT_NORM_EPS)


@functools.cache
def _latent_self_attention() -> type:
    """megatron's ``MLASelfAttention`` whose q needs no norm without a q latent.

    megatron builds MLA's latent norms only with ``qk_layernorm``, and then, for a model
    without a q latent (``q_lora_rank`` null: Moonlight), asks for a norm fused into the q
    projection, which only Transformer Engine has. DeepSeek-V3 normalises only the latents,
    so without one for q the q projection is a plain linear."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class LatentSelfAttention(MLASelfAttention):
        def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
            if self.config.q_lora_rank is not None:
                return super()._resolve_qk_norm_config(submodules)
            return {
                "linear_q_proj": submodules.linear_q_proj,
                "linear_q_up_proj": IdentityOp,
                "linear_kv_up_proj": submodules.linear_kv_up_proj,
                "q_layernorm": IdentityOp,
                "kv_layernorm": submodules.kv_layernorm,
            }

    return LatentSelfAttention


def _sparse_attention_spec(linear: Any, row: Any, norm: Any, kernels: bool) -> Any:
    """DeepSeek-V3.2's attention: megatron's absorbed MLA over its DSA core attention (the
    lightning indexer picks ``index_topk`` keys per query; attention runs over those only);
    ``kernels``: the DSA core attention on longboat's Triton kernels where they apply
    (``sparse_attention.kernel_dsattention``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
        AbsorbedMLASelfAttention,
        AbsorbedMLASelfAttentionSubmodules,
    )
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexer,
        DSAIndexerSubmodules,
        DSAttention,
        DSAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    from longboat.llm.models.deepseek_v3.sparse_attention import kernel_dsattention

    indexer = ModuleSpec(
        module=DSAIndexer,
        submodules=DSAIndexerSubmodules(
            linear_wq_b=DuplicatedLinear,
            linear_wk=DuplicatedLinear,
            k_norm=IndexerKeyNorm,
            linear_weights_proj=DuplicatedLinear,
        ),
    )
    return ModuleSpec(
        module=AbsorbedMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=AbsorbedMLASelfAttentionSubmodules(
            linear_q_proj=linear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=linear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=linear,
            core_attention=ModuleSpec(
                module=kernel_dsattention() if kernels else DSAttention,
                submodules=DSAttentionSubmodules(indexer=indexer),
            ),
            linear_proj=row,
            q_layernorm=norm,
            kv_layernorm=norm,
        ),
        metainfo={"fuse_input_layernorm": False},
    )


def _mla_attention_spec(backend: str, kernels: Any, q_latent: bool, sparse: bool = False) -> Any:
    """The ``MLASelfAttention`` spec on longboat kernels (or megatron's local modules);
    ``sparse``: DeepSeek-V3.2's (``_sparse_attention_spec``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from longboat.core.layer_kernels import LayerKernels
    from longboat.core.megatron.specs import LongboatSpecProvider

    if backend == "local":
        from megatron.core.models.backends import LocalSpecProvider

        local = LocalSpecProvider()
        norm: Any = functools.partial(
            _LocalLatentNorm, norm=local.layer_norm(rms_norm=True, for_qk=True)
        )
        linear, row, core = (
            local.column_parallel_linear(),
            local.row_parallel_linear(),
            local.core_attention(),
        )
    else:
        provider = LongboatSpecProvider(kernels or LayerKernels())
        norm = functools.partial(_LatentNorm, rms_norm=provider.kernels.rms_norm)
        linear, row = provider.column_parallel_linear(), provider.row_parallel_linear()
        core = ModuleSpec(
            module=LatentCoreAttention, params={"attention_fn": provider.kernels.attention}
        )
    if sparse:
        if backend != "local":  # the absorbed attention builds its norms from a spec
            norm = ModuleSpec(module=_LatentNorm, params={"rms_norm": provider.kernels.rms_norm})
        else:
            norm = ModuleSpec(module=_LocalLatentNorm, params={"norm": norm.keywords["norm"]})
        return _sparse_attention_spec(linear, row, norm, kernels=backend != "local")
    return ModuleSpec(
        module=_latent_self_attention(),
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=linear,
            # MLA accepts megatron's own column linear (not a subclass) for the down projections.
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=linear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=linear,
            core_attention=core,
            linear_proj=row,
            q_layernorm=norm if q_latent else IdentityOp,
            kv_layernorm=norm,
        ),
    )


def layer_specs(cfg: DeepseekV3Config, backend: str, kernels: Any) -> list[Any]:
    """One ``TransformerLayer`` spec per decoder layer (dense first, then MoE)."""
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        def te(experts: int | None) -> Any:
            return get_gpt_layer_with_transformer_engine_spec(
                num_experts=experts, moe_grouped_gemm=bool(experts), qk_layernorm=True,
                multi_latent_attention=True,
            )  # fmt: skip

        dense, moe = te(None), te(cfg.num_experts)
    else:
        from longboat.core.megatron.specs import decoder_layer_spec

        attention = _mla_attention_spec(
            backend, kernels, cfg.q_lora_rank is not None, sparse=cfg.index_topk is not None
        )

        def with_mla(spec: Any) -> Any:
            return dataclasses.replace(
                spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
            )

        dense = with_mla(decoder_layer_spec(backend=backend, kernels=kernels))
        moe = with_mla(
            decoder_layer_spec(
                num_experts=cfg.num_experts,
                backend=backend,
                kernels=kernels,
                moe_experts=cfg.moe_experts,
            )
        )
    return [dense] * cfg.first_k_dense + [moe] * (cfg.num_layers - cfg.first_k_dense)


def layer_spec(cfg: DeepseekV3Config, backend: str, kernels: Any) -> Any:
    """The family's ``layer_spec``: every decoder layer's spec as megatron's
    ``TransformerBlockSubmodules`` (the builder takes each stage's share)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(layer_specs=layer_specs(cfg, backend, kernels))


def _stage_block(tcfg: Any, specs: list[Any], norm: Any, vp_stage: int | None) -> Any:
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
        get_transformer_layer_offset,
    )

    n = get_num_layers_to_build(tcfg, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + n], layer_norm=norm)


def _mtp_block(tcfg: Any, specs: list[Any], norm: Any, linear: Any, vp_stage: int | None) -> Any:
    """The multi-token prediction block of this stage (None where it has none)."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
        get_mtp_num_layers_to_build,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    if not tcfg.mtp_num_layers or not get_mtp_num_layers_to_build(tcfg, vp_stage=vp_stage):
        return None
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=linear, mtp_model_layer=specs[-1], layer_norm=norm
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * tcfg.mtp_num_layers)


def _backend(layer_backend: str) -> str:
    """``auto`` is the longboat backend here: megatron's Transformer Engine MLA spec fuses the
    latent norms into other modules (other parameter names), taken only when asked for."""
    return "longboat" if layer_backend == "auto" else layer_backend


def build_chunks(
    cfg: DeepseekV3Config,
    *,
    kernels: Any = None,
    moe_router: type | None = None,
    precision: str = "fp32",
    device_type: str = "cpu",
    layout: Any = None,
    **config_overrides: Any,
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunks of ``cfg`` (one per virtual pipeline stage); megatron's
    parallel state must be initialised. Keywords as core's ``build_decoder``."""
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec

    from longboat.core.megatron.parallel_state import current_layout
    from longboat.core.megatron.specs import (
        KernelRMSNorm,
        LongboatSpecProvider,
        resolve_backend,
        with_moe_router,
    )

    layout = layout if layout is not None else current_layout()
    if layout is None:
        raise RuntimeError(
            "building a megatron model needs megatron's parallel state: call "
            "longboat.core.megatron.parallel_state.initialize(parallel, accelerator) first."
        )
    backend = resolve_backend(_backend(cfg.layer_backend), device_type)
    kernels = kernels if backend == "longboat" else None
    config_overrides.setdefault("use_cpu_initialization", device_type != "cuda")
    tcfg = transformer_config(
        cfg,
        backend=backend,
        tensor_parallel=layout.tensor_parallel,
        pipeline_parallel=layout.pipeline_parallel,
        virtual_pipeline_parallel=layout.virtual_pipeline_parallel,
        context_parallel=layout.context_parallel,
        expert_parallel=layout.expert_parallel,
        precision=precision,
        kernel_activation=kernels is not None and kernels.swiglu is not None,
        overrides=config_overrides,
    )
    specs = layer_specs(cfg, backend, kernels)
    if moe_router is not None:
        specs = [with_moe_router(s, moe_router) if i >= cfg.first_k_dense else s
                 for i, s in enumerate(specs)]  # fmt: skip
    if backend == "longboat":
        from longboat.core.layer_kernels import LayerKernels

        provider = LongboatSpecProvider(kernels or LayerKernels())
        norm: Any = ModuleSpec(module=KernelRMSNorm, params={"rms_norm": provider.kernels.rms_norm})
        linear = provider.column_parallel_linear()
    else:
        from megatron.core.models.backends import LocalSpecProvider

        local = LocalSpecProvider()
        norm, linear = local.layer_norm(rms_norm=True), local.column_parallel_linear()
    vpp = mps.get_virtual_pipeline_model_parallel_world_size()
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=_stage_block(tcfg, specs, norm, stage),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            pre_process=mps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=cfg.tie_embeddings,
            position_embedding_type="rope",  # MLA rotates inside the attention
            rotary_base=int(cfg.rope_theta),
            mtp_block_spec=_mtp_block(tcfg, specs, norm, linear, stage),
            vp_stage=stage,
        )
        model.model_type = getattr(model, "model_type", None)
        chunks.append(model)
    if kernels is not None and (kernels.linear is not None or kernels.grouped_linear is not None):
        from longboat.core.megatron.linears import keep_outer_layers

        keep_outer_layers(chunks, cfg.num_layers)  # FP8: the first and last layers in bf16
    device = torch.device(device_type)
    return [c.to(device) for c in chunks]

"""Decoder layer specs: megatron ``ModuleSpec`` s built on injectable kernels.

longboat.core may not import longboat.kernels (kernels sits above core), so the
kernels come in through ``LayerKernels``: the llm / vlm stacks pass
``longboat.kernels``' attention dispatch and RMSNorm, and without them the
pure-torch defaults (SDPA, ``F.rms_norm``) are used. With ``LayerKernels.add_rms_norm``
the layer is ``AddNormTransformerLayer``: the attention residual add and the pre-MLP
norm run as one kernel.  ``backend="auto"`` picks
megatron's Transformer Engine spec when ``transformer_engine`` imports and the
accelerator is CUDA, the longboat spec otherwise.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from longboat.core.layer_kernels import (
    AddRMSNormFn,
    AttentionFn,
    GLUFn,
    LayerKernels,
    QKVRopeFn,
    RMSNormFn,
    RopeFn,
    sdpa_attention,
    torch_rms_norm,
)


class KernelGLU(torch.nn.Module):
    """megatron activation module (``MLPSubmodules.activation_func``) running a GLU kernel."""

    def __init__(self, config: Any = None, *, glu: GLUFn, **unused: Any) -> None:
        super().__init__()
        self._glu = glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._glu(x)


class KernelRMSNorm(torch.nn.Module):
    """RMSNorm with megatron's norm constructor signature and an injected kernel."""

    def __init__(
        self,
        config: Any,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        rms_norm: RMSNormFn = torch_rms_norm,
        add_rms_norm: AddRMSNormFn | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # megatron reads this to decide whether the grad is TP-reduced in sequence parallel.
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self._rms_norm = rms_norm
        self._add_rms_norm = add_rms_norm

    @property
    def fuses_residual_add(self) -> bool:
        """Whether ``forward_add`` runs a fused kernel (``add_rms_norm`` was given)."""
        return self._add_rms_norm is not None

    def _linear_dtype(self, out: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        # The linears' dtype: the stream's, or with an fp32 residual stream
        # (``fp32_residual_connection``) the params' (as apex's mixed-precision norms do).
        want = self.config.params_dtype if self.config.fp32_residual_connection else stream.dtype
        return out if out.dtype == want else out.to(want)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear_dtype(self._rms_norm(x, self.weight, self.eps), x)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` in one kernel; the sum in residual's dtype."""
        if self._add_rms_norm is None:
            raise RuntimeError(
                "KernelRMSNorm.forward_add needs an add_rms_norm kernel: build the spec with "
                "LayerKernels(add_rms_norm=...)"
            )
        normed, stream = self._add_rms_norm(x, residual, self.weight, self.eps)
        return self._linear_dtype(normed, stream), stream


def is_document_offsets(attention_mask: Any) -> bool:
    """Whether a decoder's ``attention_mask`` is packed documents' ``cu_seqlens`` (a 1-D
    integer tensor; batch 1) rather than megatron's boolean mask. The longboat attention
    spec (``KernelCoreAttention``) takes either; a tensor passes megatron's layers and
    activation recompute unchanged, so the offsets reach the kernel without an [s, s] mask."""
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 1
        and not attention_mask.dtype.is_floating_point
        and attention_mask.dtype != torch.bool
    )


class KernelCoreAttention(MegatronModule):
    """megatron ``core_attention`` on top of an injected attention kernel.

    Takes megatron's ``[s, b, heads, d]`` q/k/v and returns ``[s, b, heads * d]``.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        *,
        attention_fn: AttentionFn = sdpa_attention,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "longboat's kernel attention spec does not implement context parallelism; "
                "use the Transformer Engine spec (model.layer_backend=te) for context_parallel>1."
            )
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.attention_fn = attention_fn

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "packed sequences / attention bias need the Transformer Engine spec"
            )
        mask_type = attn_mask_type or self.attn_mask_type
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # -> [b, s, h, d]
        causal = mask_type == AttnMaskType.causal
        if is_document_offsets(attention_mask):
            # Packed documents: the kernel's varlen path, no [s, s] mask built.
            out = self.attention_fn(
                q, k, v, causal=causal, scale=self.softmax_scale, cu_seqlens=attention_mask
            )
        else:
            # megatron masks are True where attention is *not* allowed.
            mask = None if attention_mask is None else ~attention_mask
            out = self.attention_fn(q, k, v, causal=causal, scale=self.softmax_scale, mask=mask)
        sq, b = query.shape[0], query.shape[1]
        return out.transpose(0, 1).reshape(sq, b, -1)


class KernelSelfAttention(SelfAttention):
    """megatron ``SelfAttention`` whose QKV split and q/k rotation run injected kernels.

    megatron rotates q and k in two ``apply_rotary_pos_emb`` calls on ``[s, b, heads, d]``
    tensors, recomputing ``cos`` / ``sin`` of the ``freqs`` table each time. Here ``forward``
    withholds ``rotary_pos_emb`` from megatron and ``get_query_key_value_tensors`` rotates q and
    k together (after the qk-norms, as megatron does) through ``[b, s, heads, d]`` strided
    views, with ``cos`` / ``sin`` computed once per ``freqs`` table and reused by every call.
    Cases the kernel does not cover (inference, packed THD sequences, interleaved or YaRN
    rotary, fused QKV RoPE) go through megatron unchanged, and so does a layer being traced
    by torch.compile (Inductor fuses megatron's rotation with the QKV split around it).
    With ``qkv_rope`` (and a layer that allows it, ``_qkv_fusable``) the fused QKV projection
    goes to that kernel whole: split and rotation in one pass each way, instead of megatron's
    split views, a reshape copy of q, the rotation and ``torch.split``'s backward.
    """

    def __init__(
        self,
        *args: Any,
        rope: RopeFn | None = None,
        qkv_rope: QKVRopeFn | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._rope = rope
        self._qkv_rope = qkv_rope if self._qkv_fusable() else None
        self._pending_freqs: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _qkv_fusable(self) -> bool:
        """No module between the split and the rotation, and a clean per-rank head layout."""
        from megatron.core.transformer.identity_op import IdentityOp

        def identity(m: Any) -> bool:
            return m is None or isinstance(m, IdentityOp)

        cfg = self.config
        return (
            identity(self.q_layernorm)
            and identity(self.k_layernorm)
            and not getattr(cfg, "attention_output_gate", False)
            and not getattr(cfg, "test_mode", False)
            and cfg.num_query_groups is not None
            and cfg.num_query_groups >= self.world_size
        )

    def _kernel_applies(self, rotary_pos_emb: Any, kwargs: dict[str, Any]) -> bool:
        cfg = self.config
        if rotary_pos_emb is None or kwargs.get("key_value_states") is not None:
            return False
        if self._rope is None and self._qkv_rope is None:
            return False
        if torch.compiler.is_compiling():
            return False  # Inductor fuses megatron's own rotation into its neighbours
        if kwargs.get("inference_context") is not None or kwargs.get("inference_params"):
            return False
        if kwargs.get("packed_seq_params") is not None:
            return False
        if isinstance(rotary_pos_emb, tuple):
            q_emb, k_emb = rotary_pos_emb
            if q_emb is not k_emb:
                return False
            rotary_pos_emb = q_emb
        if rotary_pos_emb.dim() == 4 and rotary_pos_emb.shape[1] != 1:
            return False  # per-sample angles (M-RoPE over a batch): megatron's rotation
        return not (
            cfg.rotary_interleaved
            or getattr(cfg, "apply_rope_fusion", False)
            or getattr(cfg, "fused_single_qkv_rope", False)
            or getattr(cfg, "multi_latent_attention", False)
            or getattr(cfg, "flash_decode", False)
            or self._yarn_concentration_factor not in (None, 1.0)
        )

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if args:  # megatron passes everything after the mask by keyword; stay exact if not
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        rotary_pos_emb = kwargs.get("rotary_pos_emb")
        if not self._kernel_applies(rotary_pos_emb, kwargs):
            return super().forward(hidden_states, attention_mask, **kwargs)
        freqs = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
        kwargs["rotary_pos_emb"] = None
        self._pending_freqs = freqs
        try:
            return super().forward(hidden_states, attention_mask, **kwargs)
        finally:
            self._pending_freqs = None

    def get_query_key_value_tensors(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ) -> Any:
        freqs = self._pending_freqs
        if freqs is not None and self._qkv_rope is not None and split_qkv and not output_gate:
            mixed_qkv, _ = self.linear_qkv(hidden_states)  # [s, b, groups * (qpg + 2) * d]
            cos, sin = self._rope_tables(freqs, mixed_qkv.shape[0])
            groups = self.num_query_groups_per_partition
            qpg = self.num_attention_heads_per_partition // groups
            return self._qkv_rope(mixed_qkv, groups, qpg, cos, sin)
        out = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
        )
        if freqs is None:
            return out
        if self._rope is None:
            raise RuntimeError("KernelSelfAttention: rotary embedding withheld without a kernel")
        query, key = out[0], out[1]
        cos, sin = self._rope_tables(freqs, query.shape[0])
        # [s, b, h, d] -> [b, s, h, d] views: the kernel follows the strides, no copies.
        q, k = self._rope(query.transpose(0, 1), key.transpose(0, 1), cos, sin)
        return (q.transpose(0, 1), k.transpose(0, 1), *out[2:])

    def _rope_tables(self, freqs: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos`` / ``sin`` ``[seq, rotary_dim // 2]`` of megatron's ``freqs``.

        megatron's table is ``cat(theta, theta)`` ``[>= seq, 1, 1, rotary_dim]``; it is cached
        by the model per sequence length, so the tables are cached on its identity (the held
        reference keeps that identity from being reused).
        """
        cached = self._cos_sin
        if cached is not None and cached[0] is freqs:
            return cached[1][:seq], cached[2][:seq]
        half = freqs.shape[-1] // 2
        theta = freqs.reshape(freqs.shape[0], -1)[:, :half].float()
        cos, sin = theta.cos(), theta.sin()
        self._cos_sin = (freqs, cos, sin)
        return cos[:seq], sin[:seq]


class AddNormTransformerLayer(TransformerLayer):
    """megatron ``TransformerLayer`` whose attention residual add runs inside the pre-MLP norm.

    megatron adds the attention output to the residual stream (``self_attn_bda``: a kernel
    forward, and in backward a kernel summing the stream's two gradients), then normalises
    the sum (``pre_mlp_layernorm``). Here ``forward`` runs the attention half without the
    add and hands ``(attention output, residual)`` to the norm's ``forward_add`` (one kernel
    each way, ``AddRMSNormFn``); megatron's own ``_forward_mlp`` then receives
    ``(normed, new residual)`` through its tuple-returning-norm path and runs unchanged
    (dense or MoE MLP, MLP recompute, the MLP residual add).

    Cases the fused path does not cover run megatron's layer unchanged: hidden dropout in
    training, cross-attention, selective recompute or activation offloading of the norms,
    fused-TP inference, positional arguments after ``hidden_states``. Code that calls
    ``_forward_attention`` itself (Transformer Engine CUDA-graph capture, the MoE
    all-to-all overlap schedule) gets megatron's unfused add too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending_add: tuple[torch.Tensor, torch.Tensor] | None = None
        # Whether ``forward`` fuses the attention residual add into the pre-MLP norm.
        self.fuses_attention_add = self._add_fusable()

    def _add_fusable(self) -> bool:
        return (
            bool(getattr(self.pre_mlp_layernorm, "fuses_residual_add", False))
            and isinstance(self.pre_cross_attn_layernorm, IdentityOp)
            and isinstance(self.cross_attention, IdentityOp)
            and not self.recompute_input_layernorm
            and not self.recompute_pre_mlp_layernorm
            and not self.offload_attn_norm
            and not self.offload_mlp_norm
        )

    def _add_applies(self, args: tuple[Any, ...]) -> bool:
        from megatron.core.inference.utils import InferenceMode

        if not self.fuses_attention_add or len(args) > 1:
            return False
        if self.training and self.hidden_dropout > 0.0:
            return False  # megatron's bias-dropout-add drops the attention output first
        return not (InferenceMode.is_active() and self.config.inference_fuse_tp_communication)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if not self._add_applies(args):
            return super().forward(*args, **kwargs)
        if args:
            kwargs["hidden_states"] = args[0]
        attention_out, residual, context = self._attention_without_add(**kwargs)
        self._pending_add = (attention_out, residual)
        try:
            output = self._forward_mlp(
                attention_out,
                kwargs.get("inference_context"),
                padding_mask=kwargs.get("padding_mask"),
                packed_seq_params=kwargs.get("packed_seq_params"),
            )
        finally:
            self._pending_add = None
        return output, context

    def _attention_without_add(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        rotary_pos_emb: Any = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        rotary_pos_cos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        sequence_len_offset: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        *,
        inference_params: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """megatron's ``_forward_attention`` up to, not including, the residual add.

        Returns ``(attention output [+ bias], residual, context)``; the identity
        cross-attention modules (checked at build) pass ``context`` through.
        """
        from megatron.core.utils import deprecate_inference_params

        inference_context = deprecate_inference_params(inference_context, inference_params)
        normed = self.input_layernorm(hidden_states)
        if isinstance(normed, tuple):
            normed, residual = normed
        else:
            residual = hidden_states
        if self.config.fp32_residual_connection:
            residual = residual.float()
        out, bias = self.self_attention(
            normed,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        if bias is not None:  # as megatron's bias-dropout-add: the bias added in the stream dtype
            out = out.to(residual.dtype) + bias.to(residual.dtype)
        return out, residual, context

    def _forward_pre_mlp_layernorm(self, hidden_states: torch.Tensor) -> Any:
        pending = self._pending_add
        if pending is None or pending[0] is not hidden_states:
            return super()._forward_pre_mlp_layernorm(hidden_states)
        self._pending_add = None
        self.mlp_norm_manager = None  # no offloading of the norms (``_add_fusable``)
        # (normed, x + residual): megatron's _forward_mlp takes the second as its residual.
        return self.pre_mlp_layernorm.forward_add(*pending)


class ParamsDtypeNorm:
    """megatron's torch norm (``WrappedTorchNorm``) with its parameters in the config's
    ``params_dtype``. megatron builds them in fp32 and leaves the cast to its
    ``Float16Module``, which a longboat model built in bf16 does not go through; CUDA's
    ``layer_norm`` refuses fp32 weights beside bf16 activations."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        norm = WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps, **kwargs)
        return norm.to(dtype=config.params_dtype)


class LongboatSpecProvider(LocalSpecProvider):
    """megatron's local provider with longboat's attention and RMSNorm kernels, and linears
    that add their bias inside the GEMM or, with ``LayerKernels.linear``, run their GEMMs on
    that function (``longboat.core.megatron.linears``)."""

    def __init__(self, kernels: LayerKernels) -> None:
        self.kernels = kernels

    def column_parallel_linear(self) -> Any:
        from longboat.core.megatron import linears

        if self.kernels.linear is not None:  # e.g. FP8 GEMMs
            return ModuleSpec(
                module=linears.KernelColumnParallelLinear,
                params={"linear_fn": self.kernels.linear},
            )
        return linears.EpilogueColumnParallelLinear

    def row_parallel_linear(self) -> Any:
        from longboat.core.megatron import linears

        if self.kernels.linear is not None:
            return ModuleSpec(
                module=linears.KernelRowParallelLinear, params={"linear_fn": self.kernels.linear}
            )
        return linears.EpilogueRowParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        if not rms_norm:
            from megatron.core.transformer.torch_norm import WrappedTorchNorm

            norm = super().layer_norm(rms_norm=False, for_qk=for_qk, has_residual=has_residual)
            return ParamsDtypeNorm if norm is WrappedTorchNorm else norm
        return ModuleSpec(module=KernelRMSNorm, params={"rms_norm": self.kernels.rms_norm})

    def core_attention(self):
        return ModuleSpec(
            module=KernelCoreAttention, params={"attention_fn": self.kernels.attention}
        )

    def activation_func(self):
        if self.kernels.swiglu is None:
            return None
        return ModuleSpec(module=KernelGLU, params={"glu": self.kernels.swiglu})


def transformer_engine_available() -> bool:
    """True when ``transformer_engine`` is importable (checked without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_backend(backend: str, device_type: str) -> str:
    """``auto`` -> ``te`` on CUDA with Transformer Engine installed, else ``longboat``."""
    if backend not in ("auto", "longboat", "te", "local"):
        raise ValueError(f"model.layer_backend={backend!r}: expected auto, longboat, te or local.")
    if backend == "auto":
        return "te" if device_type == "cuda" and transformer_engine_available() else "longboat"
    if backend == "te" and not transformer_engine_available():
        raise ValueError(
            "model.layer_backend='te' but transformer_engine is not installed. "
            "Fix: pip install longboat-kernels[te] or use layer_backend=auto."
        )
    return backend


def check_fp8_layer_backend(layer_backend: str, device_type: str) -> None:
    """``ConfigError`` where ``model.layer_backend`` resolves on ``device_type`` to a layer spec
    other than longboat's, the one whose linears take the FP8 GEMMs of a
    ``train.precision=fp8`` run (``auto`` picks Transformer Engine's where it is installed)."""
    from longboat.core.config.errors import ConfigError

    backend = resolve_backend(layer_backend, device_type)
    if backend != "longboat":
        raise ConfigError(
            f"resolves to the {backend} layer spec, which has no longboat FP8 linears "
            "(train.precision=fp8)",
            key="model.layer_backend",
            value=layer_backend,
            fix="set model.layer_backend=longboat",
        )


def _layer_module(kernels: LayerKernels) -> type:
    return TransformerLayer if kernels.add_rms_norm is None else AddNormTransformerLayer


def _attention_module(kernels: LayerKernels) -> type:
    if kernels.rope is None and kernels.qkv_rope is None:
        return SelfAttention
    return KernelSelfAttention


def _attention_params(kernels: LayerKernels) -> dict[str, Any]:
    if kernels.rope is None and kernels.qkv_rope is None:
        return {}
    return {"rope": kernels.rope, "qkv_rope": kernels.qkv_rope}


def decoder_layer_spec(
    *,
    num_experts: int = 0,
    qk_norm: bool = False,
    backend: str = "longboat",
    kernels: LayerKernels | None = None,
    moe_experts: str = "auto",
) -> ModuleSpec:
    """The ``TransformerLayer`` spec of a Llama / Qwen style decoder layer.

    With ``kernels.add_rms_norm`` (longboat backend) the layer is ``AddNormTransformerLayer``
    and its pre-MLP norm takes the attention residual add (same modules and parameter names,
    so checkpoints and the HF mapping are unchanged). An MoE layer of the longboat backend runs
    its experts as ``moe_experts`` says (``DecoderModelConfig.moe_experts``; ``grouped``:
    ``grouped_experts.GroupedMoELayer``).
    """
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts or None,
            moe_grouped_gemm=bool(num_experts),
            qk_layernorm=qk_norm,
        )
    if backend == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(
            num_experts=num_experts or None, qk_layernorm=qk_norm, normalization="RMSNorm"
        )
    kernels = kernels or LayerKernels()
    provider = LongboatSpecProvider(kernels)
    norm = provider.layer_norm(rms_norm=True)
    pre_mlp_norm = norm
    if kernels.add_rms_norm is not None:  # the norm that takes the attention residual add
        pre_mlp_norm = ModuleSpec(
            module=KernelRMSNorm,
            params={"rms_norm": kernels.rms_norm, "add_rms_norm": kernels.add_rms_norm},
        )
    mlp = get_mlp_module_spec_for_backend(
        backend=provider,
        num_experts=num_experts or None,
        moe_grouped_gemm=False,
        use_te_activation_func=provider.kernels.swiglu is not None,
    )
    if num_experts and resolve_moe_experts(moe_experts) == "grouped":
        mlp = _grouped_moe(mlp, kernels.swiglu, kernels.grouped_linear)
    if not num_experts:
        mlp = _glu_fused_mlp(mlp, kernels)
    return ModuleSpec(
        module=_layer_module(kernels),
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=_attention_module(kernels),
                params={"attn_mask_type": AttnMaskType.causal} | _attention_params(kernels),
                submodules=SelfAttentionSubmodules(
                    linear_qkv=provider.column_parallel_linear(),
                    core_attention=provider.core_attention(),
                    linear_proj=provider.row_parallel_linear(),
                    q_layernorm=norm if qk_norm else IdentityOp,
                    k_layernorm=norm if qk_norm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _glu_fused_mlp(mlp: Any, kernels: LayerKernels) -> Any:
    """The dense MLP spec ``mlp`` (megatron's ``partial(MLP.as_mlp_submodule, submodules=...)``)
    as ``KernelMLP`` whose down projection takes ``kernels.glu_linear`` (the SwiGLU fused into
    it), where the kernels have one with ``linear`` and ``swiglu``; else ``mlp`` unchanged."""
    import dataclasses
    import functools

    from longboat.core.megatron import linears

    if kernels.glu_linear is None or kernels.linear is None or kernels.swiglu is None:
        return mlp
    subs = mlp.keywords["submodules"]
    fc2 = ModuleSpec(
        module=linears.KernelRowParallelLinear,
        params={"linear_fn": kernels.linear, "glu_linear_fn": kernels.glu_linear},
    )
    return functools.partial(
        linears.KernelMLP.as_mlp_submodule,
        submodules=dataclasses.replace(subs, linear_fc2=fc2),
    )


MOE_EXPERTS = ("auto", "grouped", "sequential")
"""``DecoderModelConfig.moe_experts``' values."""


def resolve_moe_experts(mode: str) -> str:
    """``grouped`` or ``sequential`` for ``moe_experts`` ``mode`` (``auto``: grouped where this
    torch has a grouped GEMM)."""
    if mode not in MOE_EXPERTS:
        raise ValueError(f"model.moe_experts={mode!r}: must be one of {list(MOE_EXPERTS)}")
    if mode != "auto":
        return mode
    from longboat.core.megatron.grouped_experts import grouped_mm_available

    return "grouped" if grouped_mm_available() else "sequential"


def _moe_spec(mlp: Any, caller: str) -> tuple[Any, Any]:
    """(the MoE layer spec ``mlp``, its ``MoESubmodules``); ValueError for a dense layer."""
    import functools

    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    # megatron's MoE layer spec is a ModuleSpec or a partial of MoELayer(submodules=...).
    if isinstance(mlp, functools.partial):
        moe = mlp.keywords.get("submodules")
    else:
        moe = getattr(mlp, "submodules", None)
    if not isinstance(moe, MoESubmodules):
        raise ValueError(f"{caller}: the layer spec has no MoE layer")
    return mlp, moe


def _replace_moe(mlp: Any, moe: Any, module: type | None = None) -> Any:
    """The MoE layer spec ``mlp`` with submodules ``moe`` (and its class ``module``)."""
    import dataclasses
    import functools

    if isinstance(mlp, functools.partial):
        func = module or mlp.func
        return functools.partial(func, *mlp.args, **{**mlp.keywords, "submodules": moe})
    return dataclasses.replace(mlp, submodules=moe, module=module or mlp.module)


def _grouped_moe(mlp: Any, glu: Any, grouped_linear: Any = None) -> Any:
    """The MoE layer spec ``mlp`` as ``GroupedMoELayer`` with ``GroupedExperts`` (``glu``: the
    fused SwiGLU, None for megatron's; ``grouped_linear``: the experts' GEMMs, e.g. FP8)."""
    import dataclasses

    from longboat.core.megatron.grouped_experts import GroupedMoELayer, grouped_experts_builder

    mlp, moe = _moe_spec(mlp, "grouped experts")
    moe = dataclasses.replace(moe, experts=grouped_experts_builder(glu, grouped_linear))
    return _replace_moe(mlp, moe, GroupedMoELayer)


def with_moe_router(spec: ModuleSpec, router: type) -> ModuleSpec:
    """``spec`` (a decoder layer of any backend) with its MoE layer's router built as
    ``router`` (a megatron ``TopKRouter`` subclass); ValueError for a dense layer."""
    import dataclasses

    mlp, moe = _moe_spec(getattr(spec.submodules, "mlp", None), "with_moe_router")
    mlp = _replace_moe(mlp, dataclasses.replace(moe, router=router))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))

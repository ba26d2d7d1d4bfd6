"""longboat.kernels: Triton training kernels with torch references, and attention dispatch.

Every op takes ``impl=`` (``"torch"``, ``"triton"``, ``"auto"``; env
``LONGBOAT_KERNELS_IMPL``): auto runs the Triton kernel on CUDA tensors and the pure-torch
reference elsewhere. The Triton paths are torch custom ops (``torch.ops.longboat.*``) with
fake implementations, so ``torch.compile`` traces through them.
"""

from longboat.kernels._dispatch import meta_stands_for
from longboat.kernels.adaln import ada_layer_norm, ada_layer_norm_torch, ada_layer_norm_triton
from longboat.kernels.adamw import (
    adamw_master_step_,
    adamw_master_step_torch_,
    adamw_master_step_triton_,
)
from longboat.kernels.attention import (
    BACKENDS,
    AttentionBackendUnavailableError,
    attention,
    auto_backend,
    available_backends,
    backend_available,
    eager_attention,
    select_backend,
)
from longboat.kernels.attention_masks import (
    block_causal_mask,
    block_mask_from_dense,
    document_block_mask,
    document_ids,
    document_mask,
    prefix_lm_block_mask,
    prefix_lm_mask,
)
from longboat.kernels.fused_linear_ce import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_torch,
    fused_linear_cross_entropy_triton,
)
from longboat.kernels.gated_residual import (
    gated_residual,
    gated_residual_torch,
    gated_residual_triton,
)
from longboat.kernels.layernorm import layer_norm, layer_norm_torch, layer_norm_triton
from longboat.kernels.qkv_rope import (
    positions_for_layout,
    split_qkv_rope,
    split_qkv_rope_torch,
)
from longboat.kernels.rmsnorm import (
    add_rmsnorm,
    add_rmsnorm_torch,
    add_rmsnorm_triton,
    rms_norm,
    rms_norm_torch,
    rms_norm_triton,
)
from longboat.kernels.rope import (
    apply_rope,
    apply_rope_,
    apply_rope_torch,
    apply_rope_triton,
    rope_cos_sin,
)
from longboat.kernels.swiglu import geglu, glu, glu_torch, glu_triton, swiglu

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "AttentionBackendUnavailableError",
    "ada_layer_norm",
    "ada_layer_norm_torch",
    "ada_layer_norm_triton",
    "adamw_master_step_",
    "adamw_master_step_torch_",
    "adamw_master_step_triton_",
    "add_rmsnorm",
    "add_rmsnorm_torch",
    "add_rmsnorm_triton",
    "apply_rope",
    "apply_rope_",
    "apply_rope_torch",
    "apply_rope_triton",
    "attention",
    "auto_backend",
    "available_backends",
    "backend_available",
    "block_causal_mask",
    "block_mask_from_dense",
    "document_block_mask",
    "document_ids",
    "document_mask",
    "eager_attention",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_torch",
    "fused_linear_cross_entropy_triton",
    "gated_residual",
    "gated_residual_torch",
    "gated_residual_triton",
    "geglu",
    "glu",
    "glu_torch",
    "glu_triton",
    "layer_norm",
    "layer_norm_torch",
    "layer_norm_triton",
    "meta_stands_for",
    "positions_for_layout",
    "prefix_lm_block_mask",
    "prefix_lm_mask",
    "rms_norm",
    "rms_norm_torch",
    "rms_norm_triton",
    "rope_cos_sin",
    "select_backend",
    "split_qkv_rope",
    "split_qkv_rope_torch",
    "swiglu",
]

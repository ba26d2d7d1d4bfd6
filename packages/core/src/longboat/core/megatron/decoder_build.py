"""Build a decoder's megatron model chunks for this rank from a ``DecoderModelConfig``, and
the Llama-style layer spec every decoder in longboat uses by default."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from longboat.core.layer_kernels import LayerKernels
from longboat.core.megatron.decoder_config import DecoderModelConfig, to_transformer_config
from longboat.core.megatron.model import build_decoder_model
from longboat.core.megatron.parallel_state import current_layout
from longboat.core.megatron.specs import decoder_layer_spec, resolve_backend, with_moe_router


def build_decoder(
    cfg: DecoderModelConfig,
    *,
    kernels: LayerKernels | None = None,
    precision: str = "fp32",
    device_type: str = "cpu",
    layout: Any = None,
    transformer_config: Callable[..., Any] = to_transformer_config,
    moe_router: type | None = None,
    layer_spec: Callable[..., Any] | None = None,
    **config_overrides: Any,
) -> list[torch.nn.Module]:
    """This rank's model chunks; megatron parallel state must be initialised first.

    ``kernels`` (e.g. ``longboat.kernels.layers.longboat_layer_kernels()``) are used when
    ``cfg.layer_backend`` resolves to the longboat spec; without them its torch references.
    On CUDA the weights are initialised on the device (``use_cpu_initialization=False``):
    the values then come from megatron's device RNG tracker, so they are not bit-identical
    to a CPU init with the same seed; pass ``use_cpu_initialization=True`` for the CPU init.
    ``layout``: the parallel layout (default: megatron's current one); ``transformer_config``:
    what turns the architecture and layout into megatron's config (``to_transformer_config``).
    ``moe_router``: a ``TopKRouter`` subclass to build the MoE layers' routers with (the layer
    spec's ``MoESubmodules.router``); None keeps megatron's. With ``kernels.linear`` /
    ``kernels.grouped_linear`` (FP8 GEMMs) the first and last layers keep megatron's GEMMs and
    the bf16 grouped experts (``linears.keep_outer_layers``).
    """
    layout = layout if layout is not None else current_layout()
    if layout is None:
        raise RuntimeError(
            "building a megatron model needs megatron's parallel state: call "
            "longboat.core.megatron.parallel_state.initialize(parallel, accelerator) first."
        )
    backend = resolve_backend(cfg.layer_backend, device_type)
    kernels = kernels if backend == "longboat" else None
    spec = (layer_spec or dense_layer_spec)(cfg, backend, kernels)
    if moe_router is not None:
        spec = with_moe_router(spec, moe_router)
    config_overrides.setdefault("use_cpu_initialization", device_type != "cuda")
    tcfg = transformer_config(
        cfg,
        tensor_parallel=layout.tensor_parallel,
        pipeline_parallel=layout.pipeline_parallel,
        virtual_pipeline_parallel=layout.virtual_pipeline_parallel,
        context_parallel=layout.context_parallel,
        expert_parallel=layout.expert_parallel,
        precision=precision,
        kernel_activation=kernels is not None and kernels.swiglu is not None,
        **config_overrides,
    )
    chunks = build_decoder_model(cfg, tcfg, spec)
    if kernels is not None and (kernels.linear is not None or kernels.grouped_linear is not None):
        from longboat.core.megatron.linears import keep_outer_layers

        keep_outer_layers(chunks, cfg.num_layers)
    device = torch.device(device_type)
    return [c.to(device) for c in chunks]


def dense_layer_spec(
    cfg: DecoderModelConfig, backend: str = "longboat", kernels: LayerKernels | None = None
) -> Any:
    """The Llama-style decoder layer spec (qk-norm and MoE read from ``cfg``)."""
    return decoder_layer_spec(
        num_experts=cfg.num_experts,
        qk_norm=cfg.qk_norm,
        backend=backend,
        kernels=kernels,
        moe_experts=cfg.moe_experts,
    )

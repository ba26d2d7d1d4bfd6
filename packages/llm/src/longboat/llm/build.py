"""Build an LLM's megatron model chunks for this rank from an ``LLMModelConfig``."""

from __future__ import annotations

from typing import Any

import torch

from longboat.core.megatron.decoder_config import to_transformer_config
from longboat.core.megatron.model import build_decoder_model
from longboat.core.megatron.parallel_state import current_layout
from longboat.core.megatron.specs import resolve_backend
from longboat.llm.config import LLMModelConfig
from longboat.llm.layer_kernels import longboat_layer_kernels
from longboat.llm.models.registry import get_family


def build_model(
    cfg: LLMModelConfig,
    *,
    precision: str = "fp32",
    device_type: str = "cpu",
    kernel_options: dict[str, bool] | None = None,
    **config_overrides: Any,
) -> list[torch.nn.Module]:
    """This rank's model chunks; megatron parallel state must be initialised first.

    ``kernel_options``: switches of ``longboat_layer_kernels`` (e.g. ``{"add_rms_norm":
    False}``) for the longboat backend, to measure or rule out one kernel.

    On CUDA the weights are initialised on the device (``use_cpu_initialization=False``):
    seconds instead of minutes for a 1B model, and no host copy. The values then come from
    megatron's device RNG tracker rather than the CPU generator, so a CUDA-initialised model
    is not bit-identical to a CPU-initialised one with the same seed (same distribution;
    reproducible run to run on the same device). Pass ``use_cpu_initialization=True`` to
    get the CPU init (e.g. to compare against a CPU run).
    """
    layout = current_layout()
    if layout is None:
        raise RuntimeError(
            "build_model needs megatron's parallel state: call "
            "longboat.core.megatron.parallel_state.initialize(parallel, accelerator) first."
        )
    family = get_family(cfg.name)
    backend = resolve_backend(cfg.layer_backend, device_type)
    kernels = longboat_layer_kernels(**(kernel_options or {})) if backend == "longboat" else None
    spec = family.layer_spec(cfg, backend, kernels)
    arch = cfg.to_arch()
    config_overrides.setdefault("use_cpu_initialization", device_type != "cuda")
    tcfg = to_transformer_config(
        arch,
        tensor_parallel=layout.tensor_parallel,
        pipeline_parallel=layout.pipeline_parallel,
        virtual_pipeline_parallel=layout.virtual_pipeline_parallel,
        context_parallel=layout.context_parallel,
        expert_parallel=layout.expert_parallel,
        precision=precision,
        kernel_activation=kernels is not None and kernels.swiglu is not None,
        **config_overrides,
    )
    chunks = build_decoder_model(arch, tcfg, spec)
    device = torch.device(device_type)
    return [c.to(device) for c in chunks]

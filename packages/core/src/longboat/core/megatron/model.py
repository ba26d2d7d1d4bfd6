"""Build a megatron decoder LM (one model chunk per virtual pipeline stage).

longboat builds megatron-core's ``GPTModel`` (see docs/llm_design.md for why
not the 0.19 ``HybridModel``); this is the one place that choice lives.
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.core.megatron.decoder_config import DecoderModelConfig


def build_decoder_model(
    arch: DecoderModelConfig,
    config: Any,
    layer_spec: Any,
    *,
    parallel_output: bool = True,
) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage; a single one without VPP)."""
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt.gpt_model import GPTModel

    vpp = mps.get_virtual_pipeline_model_parallel_world_size()
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=_block_spec(config, layer_spec, stage),
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=mps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=arch.tie_embeddings,
            position_embedding_type="rope" if arch.mrope_section is None else "mrope",
            rotary_base=int(arch.rope_theta),
            rope_scaling=arch.rope_scaling_factor is not None,
            rope_scaling_factor=arch.rope_scaling_factor or 8.0,
            vp_stage=stage,
        )
        model.model_type = getattr(model, "model_type", None)
        chunks.append(model)
    return chunks


def _block_spec(config: Any, layer_spec: Any, vp_stage: int | None) -> Any:
    """The block spec; the final norm is the layers' own kernel RMSNorm when they use one.

    Given a bare layer spec, megatron builds the block's final norm with its default
    (torch) norm class, in fp32 whatever ``params_dtype`` is.
    """
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from longboat.core.megatron.specs import KernelRMSNorm

    norm = getattr(getattr(layer_spec, "submodules", None), "input_layernorm", None)
    if not (isinstance(norm, ModuleSpec) and norm.module is KernelRMSNorm):
        return layer_spec
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=norm)

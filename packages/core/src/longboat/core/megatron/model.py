"""Build a megatron decoder LM (one model chunk per virtual pipeline stage).

longboat builds megatron-core's ``GPTModel`` (see packages/llm/README.md for why
not the 0.19 ``HybridModel``); this is the one place that choice lives.
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.core.megatron.decoder_config import DecoderArch


def build_decoder_model(
    arch: DecoderArch,
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
            transformer_layer_spec=layer_spec,
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=mps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=arch.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            rope_scaling=arch.rope_scaling_factor is not None,
            rope_scaling_factor=arch.rope_scaling_factor or 8.0,
            vp_stage=stage,
        )
        model.model_type = getattr(model, "model_type", None)
        chunks.append(model)
    return chunks

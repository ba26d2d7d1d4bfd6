"""DeepSeek-V3 (also Moonlight and Kimi K2): multi-head latent attention, DeepSeekMoE with
aux-loss-free balancing, the first dense layers, YaRN, optional multi-token prediction."""

from typing import Any

from longboat.llm.models.deepseek_v3.config import FLAVORS, DeepseekV3Config
from longboat.llm.models.deepseek_v3.hf_config import DIALECT
from longboat.llm.models.deepseek_v3.lora import LORA_TARGETS
from longboat.llm.models.family import decoder_family


def _layer_spec(cfg: Any, backend: str, kernels: Any) -> Any:
    from longboat.llm.models.deepseek_v3.model import layer_spec

    return layer_spec(cfg, backend, kernels)


def _build_chunks(cfg: Any, **options: Any) -> Any:
    from longboat.llm.models.deepseek_v3.model import build_chunks

    return build_chunks(cfg, **options)


def _flops(cfg: Any, seq_len: int) -> float:
    from longboat.llm.models.deepseek_v3.flops import flops_per_sample

    return flops_per_sample(cfg, seq_len)


class _Weights:
    """The HF weight mapping, imported when used (it needs torch and megatron)."""

    def load(self, chunks: Any, cfg: Any, directory: Any, progress: Any = None) -> int:
        from longboat.llm.models.deepseek_v3.hf_weights import load_hf_weights

        return load_hf_weights(chunks, cfg, directory, progress=progress)

    def save(self, chunks: Any, cfg: Any, directory: Any) -> Any:
        from longboat.llm.models.deepseek_v3.hf_weights import save_hf_weights

        return save_hf_weights(chunks, cfg, directory)


FAMILY = decoder_family(
    "deepseek_v3",
    FLAVORS,
    description="DeepSeek-V3 / Moonlight / Kimi K2: MLA, DeepSeekMoE, aux-loss-free routing, MTP",
    dialect=DIALECT,
    layer_spec=_layer_spec,
    schema=DeepseekV3Config,
    chunk_builder=_build_chunks,
    weights=_Weights(),
    flops=_flops,
    lora_targets=LORA_TARGETS,
)

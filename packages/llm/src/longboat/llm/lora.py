"""LoRA adapters on megatron's tensor-parallel linears: core's, shared with the vlm stack.

See ``longboat.core.megatron.lora`` for the sharding of ``A`` / ``B`` under tensor
parallelism, the initialisation and the merge.
"""

from __future__ import annotations

from longboat.core.megatron.lora import (
    _HOOK,
    apply_lora,
    lora_parameters,
    merge_lora,
    merged_lora,
)

__all__ = ["_HOOK", "apply_lora", "lora_parameters", "merge_lora", "merged_lora"]

"""The vlm stack as core sees it (entry point ``longboat.stacks: vlm``).

Heavy parts are ``"module:attr"`` references, so listing stacks imports no megatron.
"""

from __future__ import annotations

from pathlib import Path

from longboat.core.config.capabilities import Capabilities
from longboat.core.stack import Stack

STACK = Stack(
    name="vlm",
    description="Vision-language models on megatron-core (Qwen2.5-VL, Qwen3-VL, "
    "LLaVA-OneVision-style composition) with HF conversion.",
    config_dir=Path(__file__).with_name("conf"),
    families_package="longboat.vlm.models",
    root_schema="longboat.vlm.train.schema:VLMExperimentConfig",
    data_schemas={
        "conversations": "longboat.vlm.train.schema:ConversationsDataConfig",
        "shapes": "longboat.vlm.train.schema:ShapesDataConfig",
    },
    console_script="longboat-vlm",
    train="longboat.vlm.train.training:train",
    validators=(
        "longboat.vlm.train.lora:validate_adapter_export",
        "longboat.core.megatron.engine.moments:moment_dtype_problems",
    ),
    capabilities=Capabilities(
        recompute=("none", "full"),  # whole ViT blocks and decoder layers
        recompute_components=("vision", "language"),
        export_adapter=True,  # LoRA adapters as a PEFT adapter (lora.enabled=true)
        precisions=("fp32", "bf16", "fp16", "fp8"),  # fp8: the language decoder's linears
        memory_plan=True,  # train.memory_budget: train.recompute over the tower and decoder
        bf16_moments=True,  # through the one-pass AdamW update (core engine.moments)
    ),
    renamed_keys={
        "model.init_from_hf": "model.init_from",
        "model.recompute": "train.recompute=full with train.recompute_components",
        "vlm.export_hf": "export.enabled",
        "vlm.export_dir": "export.dir",
        "vlm.data_workers": "data.num_workers",
    },
    examples=(
        "longboat-vlm train experiment=quickstart                       # tiny VLM, end to end on CPU",
        "longboat-vlm train experiment=sft model.init_from=checkpoints/Qwen2.5-VL-3B-Instruct data.paths=[llava.jsonl]",
    ),
    distribution="longboat-vlm",
)

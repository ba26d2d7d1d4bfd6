"""The llm stack as core sees it (entry point ``longboat.stacks: llm``).

Heavy parts are ``"module:attr"`` references, so listing stacks imports no megatron.
"""

from __future__ import annotations

from pathlib import Path

from longboat.core.config.capabilities import Capabilities
from longboat.core.stack import Stack

STACK = Stack(
    name="llm",
    description="Text LLMs on megatron-core (Llama 3, Qwen3, Qwen3-MoE) with HF conversion.",
    config_dir=Path(__file__).with_name("conf"),
    families_package="longboat.llm.models",
    root_schema="longboat.llm.train.schema:LLMExperimentConfig",
    data_schemas={
        "quickstart": "longboat.llm.train.schema:QuickstartDataConfig",
        "prepared": "longboat.llm.train.schema:PreparedDataConfig",
        "synthetic": "longboat.llm.train.schema:SyntheticTokensDataConfig",
    },
    console_script="longboat-llm",
    train="longboat.llm.train:train",
    validators=(
        "longboat.llm.validate:validate_llm",
        "longboat.core.megatron.engine.moments:moment_dtype_problems",
    ),
    config_hooks=(
        "longboat.llm.validate:model_from_checkpoint",
        "longboat.llm.validate:lora_targets_of_family",
    ),
    capabilities=Capabilities(
        recompute=("none", "full", "selective"),
        recompute_layers=True,  # with full: the first n layers of each pipeline stage
        compile=True,  # each decoder layer
        export_adapter=True,  # with LoRA
        precisions=("fp32", "bf16", "fp16", "fp8"),  # fp8: the decoder layers' linears
        memory_plan=True,  # train.memory_budget: train.recompute and the micro-batch split
        bf16_moments=True,  # through the one-pass AdamW update (core engine.moments)
    ),
    renamed_keys={
        "llm.init_from_hf": "model.init_from",
        "llm.export_hf": "export.enabled",
        "llm.export_dir": "export.dir",
        "llm.export_adapter_dir": "export.adapter_dir",
        "llm.cuda_graph": "train.cuda_graph",
        "llm.one_pass_adamw": "optim.one_pass_adamw",
    },
    examples=(
        "longboat-llm train experiment=quickstart                       # tiny LLM, end to end on CPU",
        "longboat-llm train experiment=sft model.init_from=checkpoints/Qwen3-0.6B data.paths=[chats.jsonl]",
        "torchrun --nproc-per-node 8 -m longboat.llm.cli train experiment=llama3_pretrain",
    ),
    distribution="longboat-llm",
)

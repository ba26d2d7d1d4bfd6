"""The diffusion stack as core sees it (entry point ``longboat.stacks: diffusion``).

Heavy parts are ``"module:attr"`` references, so listing stacks imports no megatron.
"""

from __future__ import annotations

from pathlib import Path

from longboat.core.config.capabilities import Capabilities
from longboat.core.stack import Stack

STACK = Stack(
    name="diffusion",
    description="Video and image diffusion transformers on megatron-core (Wan-style DiT) "
    "with flow matching and diffusers conversion.",
    config_dir=Path(__file__).with_name("conf"),
    families_package="longboat.diffusion.models",
    root_schema="longboat.diffusion.train.schema:DiffusionExperimentConfig",
    data_schemas={
        "latents": "longboat.diffusion.data.schema:LatentsDataConfig",
        "synthetic_squares": "longboat.diffusion.data.schema:SyntheticSquaresDataConfig",
    },
    console_script="longboat-diffusion",
    train="longboat.diffusion.train.training:train",
    validators=(
        "longboat.diffusion.train.checks:validate_diffusion",
        "longboat.core.megatron.engine.moments:moment_dtype_problems",
    ),
    capabilities=Capabilities(
        recompute=("none", "full", "selective"),  # selective: attention outputs kept
        recompute_layers=True,  # the first n blocks
        ema=True,  # an fp32 average of the transformer's weights (ema.*)
        export_adapter=True,  # with lora.enabled: a diffusers LoRA (train/lora.py)
        precisions=("fp32", "bf16", "fp16", "fp8"),  # fp8: the DiT blocks' linears
        memory_plan=True,  # train.memory_budget: train.recompute and the micro-batch split
        bf16_moments=True,  # through the one-pass AdamW update (core engine.moments)
    ),
    renamed_keys={
        "model.recompute_blocks": "train.recompute_layers (with train.recompute=selective)",
        "model.recompute_attention": "train.recompute=full",
        "diffusion.export": "export.enabled",
        "diffusion.export_dir": "export.dir",
    },
    examples=(
        "longboat-diffusion train experiment=quickstart                 # tiny Wan DiT on moving squares, CPU",
        "longboat-diffusion train experiment=finetune model.init_from=Wan2.1-T2V-1.3B-Diffusers data.paths=[data/latents]",
        "torchrun --nproc-per-node 8 -m longboat.diffusion.cli train experiment=finetune parallel.context_parallel=2 ...",
    ),
    distribution="longboat-diffusion",
)

"""The embodied stack as core sees it (entry point ``longboat.stacks: embodied``).

Everything heavy is a ``"module:attr"`` reference, so listing stacks imports no torch model code.
"""

from __future__ import annotations

from pathlib import Path

from longboat.core.config.capabilities import Capabilities
from longboat.core.stack import Stack

STACK = Stack(
    name="embodied",
    description="Torch-native VLA training (GR00T-N1.6, pi0.5) on LeRobot datasets; "
    "DDP / ZeRO-1 / FSDP2 / HSDP.",
    config_dir=Path(__file__).with_name("conf"),
    root_schema="longboat.embodied.config:EmbodiedExperimentConfig",
    model_schemas={
        "groot_n1_6": "longboat.embodied.config:PolicyModelConfig",
        "pi05": "longboat.embodied.config:PolicyModelConfig",
    },
    data_schemas={"lerobot": "longboat.embodied.config:LeRobotDataConfig"},
    console_script="longboat-embodied",
    train="longboat.embodied.train.trainer:train",
    validators=("longboat.embodied.config:validate_embodied",),
    capabilities=Capabilities(
        recompute=("none", "full", "selective"),  # selective: every second block
        compile=True,  # every parallel block
        precisions=("fp32", "bf16"),  # no fp16 loss scaling
        export_formats=("auto", "native", "lerobot", "isaac"),
    ),
    examples=(
        "longboat-embodied train experiment=groot_n1_6_tiny             # GR00T-N1.6 tiny, synthetic data",
        "longboat-embodied train experiment=pi05_tiny data.path=/data/my_lerobot_set",
        "torchrun --nproc-per-node 8 -m longboat.embodied.cli train experiment=groot_n1_6_tiny parallel.strategy=fsdp",
    ),
    distribution="longboat-embodied",
)

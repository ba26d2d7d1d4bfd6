"""The embodied stack as core sees it (entry point ``longboat.stacks: embodied``).

Everything heavy is a ``"module:attr"`` reference, so listing stacks imports no torch model code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from longboat.core.config.capabilities import Capabilities
from longboat.core.stack import Stack


def _export_formats() -> tuple[str, ...]:
    from longboat.embodied.config import export_formats

    return tuple(export_formats())


POLICY_SCHEMA = "longboat.embodied.config:PolicyModelConfig"
"""Every policy's ``model.*`` keys: the name, flavor, overrides, init_from and tokenizer."""


class PolicySchemas(Mapping[str, str]):
    """``model.name`` -> the policy schema, for every policy core's family registry finds
    (looked up when a config is composed, so policies on ``LONGBOAT_FAMILY_PATH`` count)."""

    def __getitem__(self, name: str) -> str:
        from longboat.embodied.models.registry import find_policy

        if find_policy(name) is None:
            raise KeyError(name)
        return POLICY_SCHEMA

    def _names(self) -> list[str]:
        from longboat.embodied.models.registry import policy_names

        return policy_names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


STACK = Stack(
    name="embodied",
    description="Torch-native VLA training (GR00T-N1.6, pi0.5) on LeRobot datasets; "
    "DDP / ZeRO-1 / FSDP2 / HSDP.",
    config_dir=Path(__file__).with_name("conf"),
    root_schema="longboat.embodied.config:EmbodiedExperimentConfig",
    model_schemas=PolicySchemas(),
    families_package="longboat.embodied.models",
    data_schemas={"lerobot": "longboat.embodied.config:LeRobotDataConfig"},
    console_script="longboat-embodied",
    train="longboat.embodied.train.trainer:train",
    validators=("longboat.embodied.config:validate_embodied",),
    capabilities=Capabilities(
        recompute=("none", "full", "selective"),  # selective: every second block
        compile=True,  # every parallel block
        precisions=("fp32", "bf16"),  # no fp16 loss scaling
        export_formats=_export_formats,  # auto, native and every policy's own
        ema=True,  # an fp32 average of the policy's weights (ema.*)
        bf16_moments=True,  # optim.moment_dtype=bf16 in the master-weight AdamW
        memory_plan=True,  # train.memory_budget: train.recompute and the micro-batch split
        export_adapter=True,  # with lora.enabled: a PEFT adapter folder (train/lora.py)
    ),
    examples=(
        "longboat-embodied train experiment=groot_n1_6_tiny             # GR00T-N1.6 tiny, synthetic data",
        "longboat-embodied train experiment=pi05_tiny data.path=/data/my_lerobot_set",
        "torchrun --nproc-per-node 8 -m longboat.embodied.cli train experiment=groot_n1_6_tiny parallel.strategy=fsdp",
    ),
    distribution="longboat-embodied",
)

"""The diffusion stack as core sees it (entry point ``longboat.stacks: diffusion``).

Heavy parts are ``"module:attr"`` references, so listing stacks imports no megatron.
"""

from __future__ import annotations

from pathlib import Path

from longboat.core.stack import Stack

STACK = Stack(
    name="diffusion",
    description="Video and image diffusion transformers on megatron-core (Wan-style DiT) "
    "with flow matching and diffusers conversion.",
    config_dir=Path(__file__).with_name("conf"),
    console_script="longboat-diffusion",
    distribution="longboat-diffusion",
)

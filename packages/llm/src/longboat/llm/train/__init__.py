"""LLM training: ``longboat-llm train experiment=<name>``.

``train`` here is the command's entry point: it says what it is doing before the run's
modules (megatron-core, transformers: seconds to import) load, then hands over to
``longboat.llm.train.training.train``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def train(cfg: Any, *, on_step: Callable[[int], None] | None = None) -> Any:
    """Train the experiment described by a composed, validated config (the ``train``
    command); its first line comes before the heavy imports."""
    if os.environ.get("RANK", "0") in ("", "0"):
        data = getattr(getattr(cfg, "data", None), "name", "?")
        print(
            f"Building the run ({getattr(cfg, 'experiment', '?')}, data={data}): loading "
            "megatron-core and transformers, then the data and the model ...",
            flush=True,
        )
    from longboat.llm.train.training import train as run

    return run(cfg, on_step=on_step)

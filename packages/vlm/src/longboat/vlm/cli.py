"""``longboat-vlm``: ``train`` / ``config`` (core's stack CLI) and ``data prepare`` /
``inspect``, ``generate``."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``longboat-vlm``."""
    from longboat.core.cli import stack_main
    from longboat.vlm.data.cli import data_main
    from longboat.vlm.generate import generate_main

    commands = {
        "data": ("prepare a run's encoded data once; inspect conversation files", data_main),
        "generate": (
            "answer questions about images with a run's export or checkpoint",
            generate_main,
        ),
    }
    return stack_main("vlm", argv, commands=commands)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``longboat-diffusion``: ``train`` / ``config`` (core's stack CLI) and ``data prepare`` /
``inspect``."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``longboat-diffusion``."""
    from longboat.core.cli import stack_main
    from longboat.diffusion.data.cli import data_main

    commands = {"data": ("prepare latent datasets from videos / images; inspect them", data_main)}
    return stack_main("diffusion", argv, commands=commands)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

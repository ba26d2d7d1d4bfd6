"""``longboat-diffusion``: ``train`` / ``config`` (core's stack CLI)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``longboat-diffusion``."""
    from longboat.core.cli import stack_main

    return stack_main("diffusion", argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

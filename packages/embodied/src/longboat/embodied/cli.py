"""``longboat-embodied``: train / config show / config list for the embodied stack.

longboat-embodied train experiment=groot_n1_6_tiny [key=value ...]
torchrun --nproc-per-node 2 -m longboat.embodied.cli train experiment=pi05_tiny parallel.strategy=fsdp
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from longboat.core.cli import stack_main


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point (core's stack CLI with the embodied train function)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return stack_main("embodied", argv)


if __name__ == "__main__":
    sys.exit(main())

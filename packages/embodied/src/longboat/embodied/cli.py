"""``longboat-embodied``: train / config show / config list for the embodied stack, and
``data make-synthetic`` (a synthetic LeRobot dataset) and ``eval`` (closed-loop evaluation
in a simulated suite, ``longboat-embodied[sim]``).

longboat-embodied train experiment=groot_n1_6_tiny [key=value ...]
longboat-embodied data make-synthetic /tmp/ds --cameras top wrist
longboat-embodied eval runs/pusht/export --suite pusht --episodes 50 --num-envs 8
torchrun --nproc-per-node 2 -m longboat.embodied.cli train experiment=pi05_tiny parallel.strategy=fsdp
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from longboat.core.cli import stack_main


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point (core's stack CLI with the embodied train function and
    the ``data`` command)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from longboat.embodied.data.cli import data_main
    from longboat.embodied.eval.cli import eval_main

    commands = {
        "data": ("LeRobot dataset tools (make-synthetic)", data_main),
        "eval": ("closed-loop evaluation of a trained policy in simulation", eval_main),
    }
    return stack_main("embodied", argv, commands=commands)


if __name__ == "__main__":
    sys.exit(main())

"""Helpers of the benchmark-script tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]


def run_script(name: str, args: list[str], timeout: float = 300) -> str:
    """Run ``tools/bench/<name>`` in a fresh process (the scripts set up torch.distributed and
    megatron's global state, which must not leak into other tests); returns its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, str(BENCH / name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout

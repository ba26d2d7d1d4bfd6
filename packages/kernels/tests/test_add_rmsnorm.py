"""Runs ``add_rmsnorm_checks.py`` (fused residual add + RMSNorm, Triton vs torch reference)
in a subprocess: on CPU under ``TRITON_INTERPRET=1`` (which must be set before triton is
imported), on CUDA with the compiled kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHECKS = Path(__file__).with_name("add_rmsnorm_checks.py")
REPO = Path(__file__).resolve().parents[3]


def _run_checks(env_extra: dict[str, str], timeout: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2", **env_extra}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CHECKS)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"add_rmsnorm checks failed ({' '.join(cmd)}):\n{tail}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], tail


def test_add_rmsnorm_matches_reference_in_interpreter() -> None:
    pytest.importorskip("triton")
    _run_checks({"TRITON_INTERPRET": "1", "LONGBOAT_KERNEL_TEST_DEVICE": "cpu"}, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_add_rmsnorm_matches_reference_on_gpu() -> None:
    _run_checks({"TRITON_INTERPRET": "0", "LONGBOAT_KERNEL_TEST_DEVICE": "cuda"}, timeout=600)

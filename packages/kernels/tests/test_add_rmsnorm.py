"""Runs ``add_rmsnorm_checks.py`` (fused residual add + RMSNorm, Triton vs torch reference)
in a subprocess (``run_checks`` in conftest.py): on CPU under ``TRITON_INTERPRET=1`` (which
must be set before triton is imported), on CUDA with the compiled kernel."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

CHECKS = "add_rmsnorm_checks.py"


def test_add_rmsnorm_matches_reference_in_interpreter(
    run_checks: Callable[[str, str], None],
) -> None:
    run_checks(CHECKS, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_add_rmsnorm_matches_reference_on_gpu(run_checks: Callable[[str, str], None]) -> None:
    run_checks(CHECKS, "cuda")

"""Runs ``fp8_checks.py`` (Triton FP8 quantisation vs the torch reference) and
``fp8_glu_checks.py`` (the SwiGLU fused into the FP8 down projection vs the unfused pair) in
a subprocess (``run_checks`` in conftest.py), and on CUDA also ``fp8_gemm_checks.py``
(``scaled_mm`` and the FP8 linear vs the emulated ones)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

CHECKS = "fp8_checks.py"


def test_fp8_quantisation_matches_reference_in_interpreter(
    run_checks: Callable[[str, str], None],
) -> None:
    run_checks(CHECKS, "cpu")


def test_fp8_glu_fusion_matches_unfused_in_interpreter(
    run_checks: Callable[[str, str], None],
) -> None:
    run_checks("fp8_glu_checks.py", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_kernels_and_gemm_on_gpu(run_checks: Callable[[str, str], None]) -> None:
    run_checks(CHECKS, "cuda")
    run_checks("fp8_glu_checks.py", "cuda")
    run_checks("fp8_gemm_checks.py", "cuda")

"""Runs ``adamw_lowmem_checks.py`` (bf16 moments and stochastically rounded bf16 weights:
Triton kernel vs torch reference) in a subprocess (``run_checks`` in conftest.py: on CPU it
sets ``TRITON_INTERPRET=1`` before triton is imported)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

CHECKS = "adamw_lowmem_checks.py"


def test_lowmem_adamw_kernel_matches_reference_in_interpreter(
    run_checks: Callable[[str, str], None],
) -> None:
    run_checks(CHECKS, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lowmem_adamw_kernel_matches_reference_on_gpu(
    run_checks: Callable[[str, str], None],
) -> None:
    run_checks(CHECKS, "cuda")

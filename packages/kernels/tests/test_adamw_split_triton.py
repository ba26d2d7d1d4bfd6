"""Runs ``adamw_split_checks.py`` (split master storage: Triton kernel vs torch reference vs
the fp32-master update) in a subprocess (``run_checks`` in conftest.py: on CPU it sets
``TRITON_INTERPRET=1`` before triton is imported, which cannot be done inside this
already-running interpreter)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

CHECKS = "adamw_split_checks.py"


def test_split_adamw_kernel_matches_reference_in_interpreter(
    run_checks: Callable[[str, str], None],
) -> None:
    run_checks(CHECKS, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_split_adamw_kernel_matches_reference_on_gpu(
    run_checks: Callable[[str, str], None],
) -> None:
    run_checks(CHECKS, "cuda")

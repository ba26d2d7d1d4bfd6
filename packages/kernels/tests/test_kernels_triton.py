"""Runs ``kernel_checks.py`` (Triton vs torch reference, fwd + bwd) in a subprocess
(``run_checks`` in conftest.py).

On CPU the subprocess sets ``TRITON_INTERPRET=1`` before triton is imported, which cannot
be done inside this already-running interpreter. The GPU variant runs the same checks on
CUDA with the compiled kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

CHECKS = "kernel_checks.py"


def test_triton_kernels_match_reference_in_interpreter(
    run_checks: Callable[[str, str], None],
) -> None:
    run_checks(CHECKS, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernels_match_reference_on_gpu(run_checks: Callable[[str, str], None]) -> None:
    run_checks(CHECKS, "cuda")

"""Shared fixtures of the embodied tests.

Also puts this folder on ``sys.path``, so that the test modules can import the shared helpers
of ``embodied_testkit.py``: the repo runs pytest with ``--import-mode=importlib``, which adds
no test folder to ``sys.path``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a whole test module (``pytestmark =
    pytest.mark.usefixtures("one_thread")``): on tiny ops, extra threads only add sync
    overhead (10-20x slower on a busy 2-core box)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)

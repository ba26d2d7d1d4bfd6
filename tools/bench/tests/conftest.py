"""Tests of the benchmark scripts (``--tiny`` shapes on CPU).

Puts ``tools/bench``, ``tools/bench/baselines`` and this folder on ``sys.path`` (pytest runs
with ``--import-mode=importlib``, which adds no folder), so the tests import the scripts and
the baselines as the scripts import each other, and the helpers of ``bench_testkit.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
for _path in (BENCH, BENCH / "baselines", Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


@pytest.fixture(scope="session")
def quickstart_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One quickstart corpus for every LLM script test (built by the first that runs)."""
    return tmp_path_factory.mktemp("quickstart_data")

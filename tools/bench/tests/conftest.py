"""Tests of the benchmark scripts (``--tiny`` shapes on CPU).

Puts ``tools/bench`` and this folder on ``sys.path`` (pytest runs with
``--import-mode=importlib``, which adds no folder; every package's tests do the same for their
testkit): the tests then import the scripts as Python does when it runs one
(``python tools/bench/<script>.py`` puts the script's folder first), the baselines as the
``baselines`` package, and the helpers of ``bench_testkit.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
for _path in (BENCH, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


@pytest.fixture(scope="session")
def quickstart_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One quickstart corpus for every LLM script test (built by the first that runs)."""
    return tmp_path_factory.mktemp("quickstart_data")

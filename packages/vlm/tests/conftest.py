"""Puts this folder on ``sys.path`` so test modules can import ``vlm_testkit`` (pytest runs
with --import-mode=importlib, which adds no test folder)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

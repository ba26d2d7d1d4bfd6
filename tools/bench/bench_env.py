"""Where and with what a benchmark ran: GPU name, package versions, commit.

Shared by every script in tools/bench so their result files describe the run the same way.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi, or "cpu" where there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "cpu"
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "cpu"


def versions(*distributions: str) -> dict[str, str]:
    """python, torch, CUDA and each named distribution's version ("absent" if missing)."""
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }
    for dist in distributions:
        try:
            out[dist.replace("-", "_")] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist.replace("-", "_")] = "absent"
    return out


def git_commit() -> str:
    """Short HEAD commit; BENCH_COMMIT overrides it (the GPU machine gets a tree without .git)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def pyplot(missing: str | None = None) -> Any:
    """matplotlib's pyplot with the file-only Agg backend, or None (printing ``missing`` if
    given) where matplotlib is not installed: plots are optional, results are not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if missing:
            print(missing, flush=True)
        return None
    return plt


def key_values(items: list[str], flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` command-line items as a dict: each value read as JSON (``3``, ``true``,
    ``[4, 4]``), else kept as the string; an item without ``=`` stops the script, naming
    ``flag``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} {item!r}: use KEY=VALUE (VALUE as JSON or a plain string)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out

"""What every benchmark script shares: where and with what it ran, how its results are
written (JSON + markdown table + PNG), ``KEY=VALUE`` options, and the run driver (a time
budget per run; a failed run is recorded, not raised).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import importlib.metadata as md
import json
import os
import platform
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DATE = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
PEAK_BF16_FLOPS = 989e12
"""Dense bf16 datasheet peak of an H100 / H200 SXM: the MFU denominator of every benchmark."""


def gpu_name() -> str:
    """The first GPU's name from nvidia-smi, or "cpu" where there is none."""
    cmd = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "cpu"
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "cpu"


def versions(*distributions: str) -> dict[str, str]:
    """python, torch, CUDA and each named distribution's version ("absent" if missing)."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    out["cuda"] = str(torch.version.cuda)
    for dist in distributions:
        try:
            out[dist.replace("-", "_")] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist.replace("-", "_")] = "absent"
    return out


def git_commit() -> str:
    """Short HEAD commit; BENCH_COMMIT overrides it (a copied tree without .git)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def result_meta(
    benchmark: str, on_gpu: bool, distributions: Sequence[str], config: dict[str, Any]
) -> dict[str, Any]:
    """The head of every result file (benchmarks/README.md), with an empty run list."""
    return {
        "benchmark": benchmark,
        "date": DATE,
        "gpu": gpu_name() if on_gpu else "cpu",
        "versions": versions(*distributions),
        "commit": git_commit(),
        "config": config,
        "runs": [],
    }


def key_values(items: list[str], flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` items as a dict, each value read as JSON (``3``, ``true``, ``[4, 4]``) or kept
    as the string; an item without ``=`` stops the script, naming ``flag``."""
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


def fmt(value: Any, spec: str = ".3f", scale: float = 1.0, suffix: str = "") -> str:
    """``value * scale`` formatted, or "-" when missing."""
    if value is None:
        return "-"
    return f"{value * scale if scale != 1.0 else value:{spec}}{suffix}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def failed_row(run: dict[str, Any], columns: int) -> list[str]:
    """A table row for a run that failed or was skipped: its name and the error's first line."""
    err = str(run.get("error", "?")).splitlines()[0][:90].replace("|", "/")
    return [run["name"], f"failed: {err}", *[""] * (columns - 2)]


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def bar_chart(plt: Any, title: str, names: list[str], panels: list[tuple[list, str]]) -> Any:
    """One bar panel per ``(values, ylabel)``, the runs on the x axis."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (values, label) in zip(axes[0], panels):
        ax.bar(names, values, color="tab:blue")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_results(
    result: dict[str, Any],
    *,
    out: Path | None,
    results_dir: Path | None,
    stem: str,
    table: str,
    note: str = "",
    plot: Callable[[Any], Any] | None = None,
) -> None:
    """``out`` (JSON), ``<results_dir>/<stem>.{json,md,png}``; ``plot(pyplot)`` makes the figure."""
    text = json.dumps(result, indent=2) + "\n"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    if results_dir is None:
        return
    results_dir.mkdir(parents=True, exist_ok=True)
    base = results_dir / stem
    base.with_suffix(".json").write_text(text)
    head = (
        f"# {stem}\n\n{result['gpu']}, commit {result['commit']}, versions "
        f"{json.dumps(result['versions'])}\n\n{note + chr(10) * 2 if note else ''}"
    )
    base.with_suffix(".md").write_text(head + table + "\n")
    plt = pyplot()
    if plt is not None and plot is not None:
        fig = plot(plt)
        if fig:  # None or an empty selection: no chart
            fig.savefig(base.with_suffix(".png"), dpi=110)
            plt.close(fig)


class RunTimeout(Exception):
    """A run outlived its time budget."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``RunTimeout`` in the main thread after ``seconds`` (0: no limit)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise RunTimeout(f"run exceeded its {seconds:.0f}s budget")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def free_memory(acc: Any) -> float:
    """Free what earlier runs left, reset the peak counter; returns GB still allocated."""
    gc.collect()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    return round(acc.memory_stats().get("allocated_gb", 0.0), 3)


def run_all(
    runs: Sequence[str],
    run_one: Callable[[str], dict[str, Any]],
    result: dict[str, Any],
    write: Callable[[], None],
    *,
    time_budget: float = 0.0,
    weights: dict[str, float] | None = None,
    describe: Callable[[dict[str, Any]], str] = lambda r: "",
) -> None:
    """Each run in turn into ``result["runs"]``, the files rewritten after each one. With a
    ``time_budget`` (seconds for all runs) each run gets the time left split by ``weights``
    (how long a run takes relative to the others) and fails alone when it overruns."""
    import torch

    t_start = time.perf_counter()
    weights = weights or {}
    for i, name in enumerate(runs):
        left = time_budget - (time.perf_counter() - t_start)
        if time_budget and left < 20:
            result["runs"].append({"name": name, "error": "skipped: time budget spent"})
            continue
        share = [weights.get(r, 1.0) for r in runs[i:]]
        budget = left * share[0] / sum(share) if time_budget else 0.0
        print(f"== {name}" + (f" (budget {budget:.0f}s)" if budget else ""), flush=True)
        try:
            with time_limit(budget):
                entry = run_one(name)
            print(f"   {describe(entry)}", flush=True)
        except Exception as exc:
            traceback.print_exc()
            entry = {"name": name, "error": f"{type(exc).__name__}: {exc}"}
        result["runs"].append(entry)
        gc.collect()
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
        write()

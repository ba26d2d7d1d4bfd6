"""The fault suite's summary table: case x stack, pass / fail and time, as markdown.

Every test of ``test_fault_suite.py`` is one (stack, case) cell. With
``LONGBOAT_FAULTS_REPORT=<path>`` set (``nox -s faults`` sets it to
``benchmarks/results/faults_<date>.md``), the table is written there when the run ends.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# tools/faults (run_stack.py) and this folder (the suite's case table) on sys.path: pytest's
# importlib mode adds neither.
for _path in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

REPORT_ENV = "LONGBOAT_FAULTS_REPORT"
"""Where the summary table goes (unset: nowhere)."""

_CELLS: dict[tuple[str, str], tuple[str, float]] = {}
_START = time.monotonic()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    report = outcome.get_result()
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "stack" not in params or "case" not in params:
        return
    key = (params["stack"], params["case"])
    if report.when == "setup" and report.outcome != "passed":
        _CELLS[key] = ("skip" if report.skipped else "error", report.duration)
    elif report.when == "call":
        _CELLS[key] = ({"passed": "pass", "failed": "FAIL"}[report.outcome] if not report.skipped
                       else "skip", report.duration)  # fmt: skip
    else:
        return
    _write_report()  # after every cell: a run stopped early keeps what it measured


def summary_table(cells: dict[tuple[str, str], tuple[str, float]]) -> str:
    """The markdown table of ``cells``: rows are cases, columns stacks, cells ``pass 12s``."""
    stacks = sorted(
        {s for s, _ in cells},
        key=lambda s: (s not in ORDER, ORDER.index(s) if s in ORDER else 0, s),
    )
    cases = sorted(
        {c for _, c in cells},
        key=lambda c: (c not in CASE_ORDER, CASE_ORDER.index(c) if c in CASE_ORDER else 0, c),
    )
    lines = ["| case | " + " | ".join(stacks) + " |", "|---|" + "---|" * len(stacks)]
    for case in cases:
        row = []
        for stack in stacks:
            status, seconds = cells.get((stack, case), ("-", 0.0))
            row.append(status if status == "-" else f"{status} ({seconds:.0f}s)")
        lines.append(f"| {case} | " + " | ".join(row) + " |")
    return "\n".join(lines)


ORDER = ["core", "llm", "vlm", "diffusion", "embodied"]
CASE_ORDER = [
    "rank_raise",
    "rank_kill",
    "rank_hang",
    "kill_mid_save",
    "ctrl_c",
    "corrupt_latest",
    "disk_full",
    "bad_shard",
    "torchrun_restart",
]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write_report()


def _write_report() -> None:
    path = os.environ.get(REPORT_ENV)
    if not path or not _CELLS:
        return
    from test_fault_suite import CASES  # the descriptions of the cases

    passed = sum(status == "pass" for status, _ in _CELLS.values())
    now = dt.datetime.now(dt.UTC)
    text = [
        f"# Fault-injection suite, {now:%Y-%m-%d}",
        "",
        f"`pytest tools/faults/tests -m faults` (what `nox -s faults` runs) on {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{now:%H:%M} UTC, {(time.monotonic() - _START) / 60:.0f} minutes so far: {passed} of "
        f"{len(_CELLS)} cells run pass (`-` marks a cell not run). Each cell is one fault on "
        "one stack at tiny CPU shapes (gloo for the two-process cases), then the same command "
        "again; it passes when the faulty run stopped as specified and the resumed run's "
        "per-step losses equal an uninterrupted run's, bit for bit. Times are wall seconds "
        "of the cell (its faulty run and its restart; the uninterrupted reference of each "
        "stack and world size is timed in the first cell that needs it).",
        "",
        summary_table(_CELLS),
        "",
        "| case | fault | what must hold |",
        "|---|---|---|",
        *(f"| {name} | {case.fault_doc} | {case.expect_doc} |" for name, case in CASES.items()),
        "| bad_shard | bytes of a data file damaged (each stack's own reader test: "
        "`BAD_SHARD_TESTS`) | one line naming the file and the row / episode, exit 2, before "
        "any step |",
        "| torchrun_restart | `torchrun --max-restarts N`, two ranks; rank 1 raises after step 3 "
        "in each of the first N attempts (`TORCHRUN_RESTARTS`: core 8, llm 2) | each attempt "
        "names rank 1; each restart joins the job's store afresh and resumes at 2; the last "
        "one ends with exit 0 and the reference losses |",
        "",
    ]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(text))

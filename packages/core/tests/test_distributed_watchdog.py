"""The rank watchdog: a hung step is reported with the rank's Python stack, and a rank that
raises in a two-process run stops its peer with one line naming it and its last step."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from longboat.core.config.compose import compose_experiment
from longboat.core.distributed import run_multiprocess
from longboat.core.distributed.watchdog import RankWatchdog, peer_error
from longboat.core.errors import RankFailure


def _stuck_here(seconds: float) -> None:
    time.sleep(seconds)


def test_a_step_without_progress_is_reported_with_the_python_stack(tmp_path: Path) -> None:
    out = (tmp_path / "stderr.txt").open("w+")
    watchdog = RankWatchdog(collective_timeout_s=60.0, out=out)
    watchdog.heartbeat_s, watchdog.min_hang_s, watchdog.hang_factor = 0.05, 0.3, 10.0
    with watchdog:
        for step in range(1, 6):  # steps of ~10 ms: the median
            time.sleep(0.01)
            watchdog.progress(step)
        assert 0.3 <= watchdog.hang_threshold_s() < 0.6
        _stuck_here(1.5)
    out.seek(0)
    text = out.read()
    assert "rank 0: step 6 made no progress for" in text
    assert "not in a collective" in text
    assert "_stuck_here" in text  # faulthandler's dump of the main thread
    assert text.count("made no progress") == 1  # once per stall


def test_the_hang_threshold_is_a_multiple_of_the_median_bounded_by_the_timeout() -> None:
    w = RankWatchdog(collective_timeout_s=100.0, out=io.StringIO())
    assert w.hang_threshold_s() == 50.0  # no median yet: half the collective timeout
    w._durations.extend([0.1, 0.2, 10.0])
    assert w.hang_threshold_s() == max(w.min_hang_s, w.hang_factor * 0.2)
    w._durations.extend([100.0] * 5)
    assert w.hang_threshold_s() == 50.0


def test_collective_errors_are_told_from_a_ranks_own_error() -> None:
    gloo_closed = RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:6367")
    gloo_timeout = RuntimeError("[unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    assert peer_error(gloo_closed) and peer_error(gloo_timeout)
    assert not peer_error(RuntimeError("fault injected")) and not peer_error(KeyError("x"))


def _raises_on_rank_1(rank: int, world: int, root: str) -> tuple[str, str, bool, int]:
    from longboat.core.demo import run

    cfg = compose_experiment(
        "demo",
        [
            f"output_dir={root}",
            "logging.progress=false",
            "logging.trackers=[]",
            "train.steps=8",
            "train.collective_timeout_s=30",
        ],
        stack="core",
    )

    def on_step(step: int) -> None:
        if step == 3 and rank == 1:
            raise ValueError("fault injected on rank 1")

    try:
        run(cfg, on_step=on_step)
    except RankFailure as exc:
        return "stopped", str(exc), exc.report, exc.exit_code
    except ValueError as exc:
        return "raised", str(exc), False, 1
    return "finished", "", False, 0


@pytest.mark.multiprocess
def test_a_rank_that_raises_stops_its_peer_naming_it(tmp_path: Path) -> None:
    t0 = time.monotonic()
    survivor, failed = run_multiprocess(_raises_on_rank_1, 2, str(tmp_path), timeout=120)
    assert failed == ("raised", "fault injected on rank 1", False, 1)
    kind, line, report, code = survivor
    assert (kind, report, code) == ("stopped", True, 3)  # the survivor reports, exit 3
    assert line.startswith(
        "rank 1 failed after step 3 (ValueError: fault injected on rank 1); every rank stops "
        "(train.collective_timeout_s=30)"
    ), line
    assert "\n" not in line
    assert time.monotonic() - t0 < 100

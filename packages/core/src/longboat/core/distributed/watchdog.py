"""Rank failures in a multi-process run: a bounded stop, one line naming the rank, hung steps.

``RankWatchdog`` runs beside the training loop on every rank (``Trainer.fit`` starts it):

- a **heartbeat**: a background thread writes ``<beat> <step>`` to the job's rendezvous
  store every ``HEARTBEAT_S`` seconds, so a peer can tell a rank that is gone (killed, frozen,
  its host lost) from one that is alive;
- a **hung-step report**: when the loop makes no progress for ``HANG_FACTOR`` times the
  median step time (at least ``MIN_HANG_S``, at most half of ``train.collective_timeout_s``,
  which also applies until three steps are timed),
  the rank prints one line and its Python stacks (``faulthandler``) to stderr, and records in
  the store whether it waits in a collective or is stuck elsewhere;
- a **bounded stop**: a rank with no progress for ``train.collective_timeout_s`` plus
  ``EXIT_GRACE_S`` names the culprit and exits (exit ``RANK_FAILURE_EXIT``); its peers have
  by then timed out in their collective (the process groups' timeout is the same key);
- **diagnosis**: when a collective fails (a peer died: gloo reports a closed connection at
  once; a peer hung: the collective times out), ``failure`` reads every rank's record from
  the store and names the rank that failed first, its last completed step and why (its
  exception, gone, or stuck outside a collective). ``RankFailure`` carries that line; the
  lowest surviving rank prints it. The rank that raised keeps its own error.

Nothing here touches a checkpoint: a save a failure interrupts was never renamed into place
(``CheckpointManager``), so the restart (``torchrun --max-restarts N``, or the same command
again) resumes from the last complete checkpoint and continues the run exactly.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, TextIO

import torch.distributed as dist

from longboat.core.distributed.init import launch_store_prefix
from longboat.core.errors import RankFailure, UserError

HEARTBEAT_S = 1.0
"""Seconds between two heartbeats of a rank."""
HANG_FACTOR = 20.0
"""A step is reported hung after this many median step times without progress."""
MIN_HANG_S = 5.0
"""...but never before this many seconds (short steps jitter)."""
EXIT_GRACE_S = 10.0
"""A rank stuck this long past ``train.collective_timeout_s`` exits by itself."""
RANK_FAILURE_EXIT = RankFailure.exit_code
"""Exit status of the ranks a peer's failure stopped."""
_GONE_BEATS = 3
"""A peer whose heartbeat did not move for this many beats is gone."""
_COLLECTIVE_FRAMES = (
    f"torch{os.sep}distributed{os.sep}",
    f"torch{os.sep}autograd{os.sep}",  # DDP's gradient all-reduce waits inside backward
    f"megatron{os.sep}core{os.sep}distributed{os.sep}",
    f"megatron{os.sep}core{os.sep}pipeline_parallel{os.sep}",
)
_PEER_ERROR_WORDS = (
    "connection closed by peer",
    "connection reset by peer",
    "timed out",
    "timeout",
    "gloo",
    "nccl",
    "broken pipe",
    "socket",
)


def peer_error(exc: BaseException) -> bool:
    """Whether ``exc`` is what a rank sees when a peer fails (a collective error or timeout),
    rather than a failure of its own."""
    if isinstance(exc, dist.DistError):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, RuntimeError | OSError | UserError) and any(
        w in text for w in _PEER_ERROR_WORDS
    )


def _in_collective(frame: Any) -> bool:
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _COLLECTIVE_FRAMES):
            return True
        frame = frame.f_back
    return False


def _store(timeout_s: float) -> Any | None:
    """A client of the job's rendezvous store of its own (a peer's blocking call on the
    process group's client cannot stall it), keys under this launch's prefix
    (``launch_store_prefix``: nothing an earlier attempt wrote is read)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        client = dist.TCPStore(
            addr,
            int(port),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError, OSError):
        return None
    launch = launch_store_prefix()
    if launch is not None:
        return dist.PrefixStore(f"{launch}watchdog/", client)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a group made elsewhere
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return dist.PrefixStore(f"longboat/watchdog/{run}/{attempt}/", client)


class RankWatchdog:
    """Heartbeat, hung-step report, bounded stop and failure diagnosis of one rank (module
    doc). Use as a context manager around the loop; call ``progress`` after each step."""

    def __init__(
        self,
        *,
        collective_timeout_s: float,
        rank: int = 0,
        world_size: int = 1,
        out: TextIO | None = None,
    ) -> None:
        self.timeout_s = float(collective_timeout_s)
        self.rank, self.world_size = rank, world_size
        self.out = out or sys.stderr
        self.step = 0
        """Steps completed (the loop's step counter)."""
        self._first_step = 0
        self.heartbeat_s, self.hang_factor, self.min_hang_s = HEARTBEAT_S, HANG_FACTOR, MIN_HANG_S
        """The module's constants, per instance (a test shortens them)."""
        self._last = time.monotonic()
        self._durations: deque[float] = deque(maxlen=64)
        self._reported_hang = False
        self._in_steps = True
        self._beat = 0
        self._stop = threading.Event()
        self._done = threading.Lock()  # taken once: the first failure path reports
        self._store = _store(min(5.0, self.timeout_s)) if world_size > 1 else None
        self._had_store = self._store is not None
        self._main = threading.main_thread().ident
        self._thread: threading.Thread | None = None

    @classmethod
    def for_run(cls, collective_timeout_s: float, *, step: int = 0) -> RankWatchdog:
        """The watchdog of this process's rank (a single process: hung-step reports only),
        for a loop that starts after ``step`` completed steps."""
        if dist.is_available() and dist.is_initialized():
            watchdog = cls(
                collective_timeout_s=collective_timeout_s,
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
            )
        else:
            watchdog = cls(collective_timeout_s=collective_timeout_s)
        watchdog.step = step
        return watchdog

    # --- the loop's side -------------------------------------------------------------------

    def __enter__(self) -> RankWatchdog:
        self._last = time.monotonic()
        self._first_step = self.step
        self._thread = threading.Thread(target=self._watch, name="longboat-watchdog", daemon=True)
        self._thread.start()
        return self

    def progress(self, step: int) -> None:
        """Step ``step`` completed (cheap: no store access on the loop's thread)."""
        now = time.monotonic()
        if self.step > self._first_step:  # the first step (warm-up, compile) is not timed
            self._durations.append(now - self._last)
        self.step, self._last = step, now
        self._reported_hang = False

    def touch(self) -> None:
        """Progress without a step (a save or an eval finished)."""
        self._last = time.monotonic()

    def steps_done(self) -> None:
        """The loop's steps are over: the end of the run (final save, export, plot) is timed
        by the collective timeout alone, not reported as a hung step."""
        self._in_steps = False
        self.touch()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._stop.set()
        if exc is None or self.world_size < 2 or not isinstance(exc, Exception):
            return
        failure = self.failure(exc)
        if failure is not None:
            raise failure from None

    # --- diagnosis -------------------------------------------------------------------------

    def hang_threshold_s(self) -> float:
        """Seconds without progress after which the step is reported hung (module doc)."""
        if len(self._durations) < 3:  # no median yet (the first steps warm up, compile)
            return self.timeout_s / 2
        median = statistics.median(self._durations)
        return min(max(self.min_hang_s, self.hang_factor * median), self.timeout_s / 2)

    def failure(self, exc: BaseException | None) -> RankFailure | None:
        """After this rank's loop failed with ``exc`` (None: it is stuck past the collective
        timeout): record it, find the rank that failed first and return the ``RankFailure``
        naming it, or None when that rank is this one (its own error stands)."""
        if not self._done.acquire(blocking=False):
            return None
        peer = exc is None or peer_error(exc)
        what = "stuck past train.collective_timeout_s" if exc is None else _one_line(exc)
        self._set(f"fault/{self.rank}", f"{time.time():.6f}\t{self.step}\t{int(peer)}\t{what}")
        if not peer:
            return None  # this rank failed first: its own error is the message
        _exit_later(EXIT_GRACE_S, RANK_FAILURE_EXIT)  # should the teardown block
        culprit = self._find_culprit_through_sigterm()
        if culprit is None:
            line = (
                f"a peer rank failed at step {self.step + 1} (rank {self.rank} saw: {what}); "
                "every rank stops"
            )
            survivors = set(range(self.world_size))
        else:
            rank, step, why = culprit
            line = (
                f"rank {rank} failed after step {step} ({why}); every rank stops "
                f"(train.collective_timeout_s={self.timeout_s:g}). Run the command again "
                "(or torchrun --max-restarts) to resume from the last checkpoint"
            )
            survivors = set(range(self.world_size)) - {rank}
        return RankFailure(line, report=self.rank == min(survivors | {self.rank}))

    def _find_culprit_through_sigterm(self) -> tuple[int, int, str] | None:
        """``_find_culprit`` with SIGTERM held off (a launcher such as torchrun's agent
        terminates the other ranks as soon as one fails; it waits a while before SIGKILL)."""
        if threading.current_thread() is not threading.main_thread():
            return self._find_culprit()
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            return self._find_culprit()
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _find_culprit(self) -> tuple[int, int, str] | None:
        """(rank, last completed step, why) of the rank that failed first, from the store:
        an own error, else gone (heartbeat stopped), else stuck outside a collective."""
        lost = (0, self.step, "unreachable, and with it the job's store it hosts")
        if self._store is None:
            return lost if self._had_store else None
        others = [r for r in range(self.world_size) if r != self.rank]
        first = {r: self._get(f"hb/{r}") for r in others}
        end = time.monotonic() + _GONE_BEATS * self.heartbeat_s + 0.5
        while True:
            own = self._own_errors(others)
            if own:
                _t, rank, step, what = min(own)
                return rank, step, what
            if time.monotonic() >= end:
                break
            time.sleep(0.1)
        if not self._reachable():
            return lost
        gone = []
        for r in others:
            now = self._get(f"hb/{r}")
            if now is None or now == first[r]:
                step = int(now.split()[1]) if now else self.step
                gone.append((r, step))
        if gone:
            rank, step = gone[0]
            return (
                rank,
                step,
                f"no heartbeat for {_GONE_BEATS * self.heartbeat_s:.0f}s: the process is gone",
            )
        for r in others:
            stall = self._get(f"stall/{r}")
            if stall is not None:
                step, inside = stall.split("\t")[:2]
                if inside == "0":
                    return r, int(step), "hung outside any collective; its stack is in its log"
        return None

    def _own_errors(self, ranks: list[int]) -> list[tuple[float, int, int, str]]:
        found = []
        for r in ranks:
            raw = self._get(f"fault/{r}")
            if raw is None:
                continue
            t, step, peer, what = raw.split("\t", 3)
            if peer == "0":
                found.append((float(t), r, int(step), what))
        return found

    # --- the watchdog thread ---------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._beat += 1
            self._set(f"hb/{self.rank}", f"{self._beat} {self.step}")
            idle = time.monotonic() - self._last
            if self._in_steps and not self._reported_hang and idle > self.hang_threshold_s():
                self._reported_hang = True
                self._report_hang(idle)
            if self.world_size > 1 and idle > self.timeout_s + EXIT_GRACE_S:
                self._exit_stuck()
                return

    def _main_frame(self) -> Any:
        return sys._current_frames().get(self._main) if self._main is not None else None

    def _report_hang(self, idle: float) -> None:
        inside = _in_collective(self._main_frame())
        where = "waiting in a collective" if inside else "not in a collective"
        self._set(f"stall/{self.rank}", f"{self.step}\t{int(inside)}")
        median = statistics.median(self._durations) if self._durations else float("nan")
        print(
            f"rank {self.rank}: step {self.step + 1} made no progress for {idle:.0f}s "
            f"(median step {median:.3g}s; {where}); Python stacks of rank {self.rank}:",
            file=self.out,
            flush=True,
        )
        try:
            faulthandler.dump_traceback(file=self.out, all_threads=True)
        except (OSError, ValueError, AttributeError):  # no file descriptor behind ``out``
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)

    def _exit_stuck(self) -> None:
        """No progress past the collective timeout: this rank is the hung one (outside any
        collective) or waits on one whose failure its collective did not raise (NCCL)."""
        if _in_collective(self._main_frame()):
            failure = self.failure(None)
            if failure is not None and failure.report:
                print(f"error: {failure}", file=self.out, flush=True)
        elif self._done.acquire(blocking=False):
            what = f"hung outside any collective for {self.timeout_s + EXIT_GRACE_S:.0f}s"
            self._set(f"fault/{self.rank}", f"{time.time():.6f}\t{self.step}\t0\t{what}")
            print(f"error: rank {self.rank} {what} after step {self.step}; it stops",
                  file=self.out, flush=True)  # fmt: skip
        else:  # the main thread is reporting a failure already
            time.sleep(EXIT_GRACE_S)
        os._exit(RANK_FAILURE_EXIT)

    # --- store access (never raises: the store may be gone with its host) ------------------

    def _set(self, key: str, value: str) -> None:
        if self._store is None:
            return
        try:
            self._store.set(key, value)
        except (RuntimeError, OSError, ValueError):
            self._lost_store()

    def _reachable(self) -> bool:
        if self._store is None:
            return False
        try:
            self._store.check([f"hb/{self.rank}"])
        except (RuntimeError, OSError, ValueError):
            self._lost_store()
            return False
        return True

    def _get(self, key: str) -> str | None:
        if self._store is None:
            return None
        try:
            if not self._store.check([key]):
                return None
            return self._store.get(key).decode()
        except (RuntimeError, OSError, ValueError):
            self._lost_store()
            return None

    def _lost_store(self) -> None:
        """The store's host is gone: stop talking to it (each try would log a warning)."""
        self._store = None


def _exit_later(seconds: float, code: int) -> None:
    """End the process after ``seconds`` unless it ended before (teardown after a peer's
    failure can block in a broken process group, or abort at interpreter exit)."""

    def end() -> None:
        time.sleep(seconds)
        sys.stderr.flush()
        os._exit(code)

    threading.Thread(target=end, name="longboat-exit", daemon=True).start()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


__all__ = [
    "EXIT_GRACE_S",
    "HANG_FACTOR",
    "HEARTBEAT_S",
    "MIN_HANG_S",
    "RANK_FAILURE_EXIT",
    "RankFailure",
    "RankWatchdog",
    "peer_error",
]

"""A stack's ``train`` command with one fault injected: the process the fault suite launches.

    python tools/faults/run_stack.py STACK [--fault KIND@STEP[:RANK]] [--fault-attempts N] train ...

runs ``longboat-STACK train ...`` exactly as the console script does (same composition,
validation, trainer, exit codes), plus one fault after step STEP on rank RANK (every rank
when omitted):

- ``raise``: the rank raises an exception of its own;
- ``kill``: the rank SIGKILLs itself;
- ``hang``: the rank sleeps inside the loop (alive, outside any collective);
- ``sigint``: a Ctrl-C (the run finishes the step, saves and stops, exit 130);
- ``kill_mid_save``: the save of step STEP pauses after its shards are written and the
  process is SIGKILLed there (a temp folder with every shard, no manifest);
- ``disk_full``: the save of step STEP fails with ENOSPC while DCP writes the shards.

Launched once per rank with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) for
a multi-process run, or by ``torchrun --max-restarts N`` itself: the fault then happens in
the first ``--fault-attempts`` attempts (default 1) and the later ones run clean.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

FAULTS = ("raise", "kill", "hang", "sigint", "kill_mid_save", "disk_full")


def _parse_fault(spec: str | None) -> tuple[str, int, int | None] | None:
    if not spec:
        return None
    kind, _, where = spec.partition("@")
    step, _, rank = where.partition(":")
    if kind not in FAULTS or not step.isdigit():
        raise SystemExit(f"--fault {spec!r}: expected KIND@STEP[:RANK], KIND one of {FAULTS}")
    return kind, int(step), int(rank) if rank else None


def _kill_when_shards_written(ckpt_dir: Path, step: int) -> None:
    """SIGKILL this process once the temp folder of ``step`` holds DCP's ``.metadata``."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any((p / ".metadata").exists() for p in ckpt_dir.glob(f".tmp-step_{step:08d}-*")):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.02)


def _fill_disk() -> None:
    """From now on DCP's shard writes fail as on a full disk."""
    from torch.distributed.checkpoint import FileSystemWriter

    from longboat.core.checkpoint import manager

    class FullDiskWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    manager.FileSystemWriter = FullDiskWriter


def _inject(kind: str, cfg: Any) -> None:
    if kind == "raise":
        raise RuntimeError("fault injected by the fault suite")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(3600)
    if kind == "sigint":
        os.kill(os.getpid(), signal.SIGINT)
    if kind == "kill_mid_save":
        from longboat.core.checkpoint import TEST_PAUSE_AT_ENV, TEST_PAUSE_ENV

        os.environ[TEST_PAUSE_ENV], os.environ[TEST_PAUSE_AT_ENV] = "120", "shards"
        step = int(os.environ["LONGBOAT_FAULT_STEP"])
        watcher = threading.Thread(
            target=_kill_when_shards_written, args=(Path(cfg.checkpoint.dir), step), daemon=True
        )
        watcher.start()
    if kind == "disk_full":
        _fill_disk()


def main(argv: list[str] | None = None) -> int:
    """Parse ``STACK [--fault ...]`` and run the stack's command line with the fault."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stack")
    parser.add_argument("--fault", default=None)
    parser.add_argument("--fault-attempts", type=int, default=1)
    args, rest = parser.parse_known_args(argv)
    fault = _parse_fault(args.fault)

    from longboat.core.cli import stack_main
    from longboat.core.stack import get_stack

    stack_train = get_stack(args.stack).resolve_train()
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) >= args.fault_attempts:
        fault = None  # torchrun's restarts after the faulty attempts run clean

    def train(cfg: Any) -> Any:
        if fault is None:
            return stack_train(cfg)
        kind, at, on_rank = fault
        os.environ["LONGBOAT_FAULT_STEP"] = str(at)

        def on_step(step: int) -> None:
            if step == at and on_rank in (None, rank):
                _inject(kind, cfg)

        return stack_train(cfg, on_step=on_step)

    return stack_main(args.stack, rest, train=train)


if __name__ == "__main__":
    sys.exit(main())

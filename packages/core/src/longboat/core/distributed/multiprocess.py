"""Run a function on N CPU processes with torch.distributed (gloo) initialised.

The test helper every package uses for world sizes 2 and 4 on CPU. On Linux
the workers are forked, so ``fn`` may live in a pytest test module imported in
importlib mode (which a spawned child could not import by name). With
``start_method="spawn"`` the function is re-imported in the child from its
source file instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class MultiprocessError(RuntimeError):
    """A worker of ``run_multiprocess`` raised, crashed or timed out."""


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _FunctionRef:
    """Picklable handle to a module-level function, resolvable from its file path."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.module = fn.__module__
        self.qualname = fn.__qualname__
        self.file = inspect.getsourcefile(fn) or ""
        if "<locals>" in self.qualname:
            raise ValueError(
                f"run_multiprocess(start_method='spawn') needs a module-level function, got "
                f"{self.qualname!r}. Fix: move it to module level or use start_method='fork'."
            )

    def resolve(self) -> Callable[..., Any]:
        module = sys.modules.get(self.module)
        if module is None:
            try:
                module = importlib.import_module(self.module)
            except ImportError:
                # pytest importlib mode: the test module is not importable by name.
                spec = importlib.util.spec_from_file_location(self.module, self.file)
                if spec is None or spec.loader is None:
                    raise
                module = importlib.util.module_from_spec(spec)
                sys.modules[self.module] = module
                spec.loader.exec_module(module)
        obj: Any = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


def _worker(
    fn: Callable[..., Any] | _FunctionRef,
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    args: tuple[Any, ...],
    results: Any,
    timeout_s: float,
) -> None:
    reported = False
    try:
        # OpenMP is not fork-safe: a forked child that starts an OMP pool can hang. One
        # intra-op thread per rank also avoids oversubscribing small CI machines.
        import torch

        torch.set_num_threads(1)
        import torch.distributed as dist

        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        if backend == "gloo":
            os.environ["LONGBOAT_ACCELERATOR"] = "cpu"
        func = fn.resolve() if isinstance(fn, _FunctionRef) else fn
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            value = func(rank, world_size, *args)
        except BaseException:
            # Report before tearing the group down: peers then fail in their collectives, and
            # the timestamp lets the parent tell this root cause from those follow-on errors.
            results.put((rank, "error", (time.time(), traceback.format_exc())))
            reported = True
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        if not reported:
            results.put((rank, "error", (time.time(), traceback.format_exc())))


def run_multiprocess(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return values by rank.

    torch.distributed is initialised in each worker (``backend``, free local port)
    and the torchrun variables (RANK, WORLD_SIZE, ...) are set, so code calling
    ``init_distributed()`` works unchanged. With gloo, workers also get
    ``LONGBOAT_ACCELERATOR=cpu``. Each worker uses one intra-op thread.

    Raises ``MultiprocessError`` with the failing rank's traceback if any worker
    raises or dies, and after ``timeout`` seconds (naming the ranks still running).
    Return values must be picklable.
    """
    if world_size < 1:
        raise ValueError(f"run_multiprocess: world_size must be >= 1, got {world_size}")
    if start_method is None:
        start_method = "fork" if sys.platform.startswith("linux") else "spawn"
    import torch.distributed as dist

    if start_method == "fork" and dist.is_available() and dist.is_initialized():
        # A forked child would inherit the parent's live process group (sockets, helper
        # threads) and hang or crash in its own init; say so instead.
        raise RuntimeError(
            "run_multiprocess: torch.distributed is initialised in this process, so forked "
            "workers would inherit its process group; call destroy_distributed() first, or "
            "run the code that initialised it in a subprocess"
        )
    ctx = mp.get_context(start_method)
    if start_method == "fork":
        _warm_imports()
    target: Callable[..., Any] | _FunctionRef = fn if start_method == "fork" else _FunctionRef(fn)
    port = find_free_port()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(target, rank, world_size, port, backend, args, results, timeout),
            name=f"longboat-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    with warnings.catch_warnings():
        # Python warns when forking a process that has threads (pytest, TensorBoard, gloo
        # helpers). The known hazard for torch, OpenMP's pool, is handled in the worker.
        warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks")
        for p in procs:
            p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    ok = False
    try:
        while len(outputs) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.1)
            except queue.Empty:
                _check_dead(procs, outputs, results)
                if time.monotonic() > deadline:
                    pending = sorted(set(range(world_size)) - set(outputs))
                    raise MultiprocessError(
                        f"run_multiprocess({_name(fn)}, world_size={world_size}) timed out after "
                        f"{timeout:.0f}s; ranks still running: {pending}"
                    ) from None
                continue
            if status == "error":
                raise _failure(fn, world_size, {rank: payload}, results)
            outputs[rank] = pickle.loads(payload)
        ok = True
    finally:
        # After a failure the other ranks are usually stuck in a collective: stop them now.
        _stop(procs, grace_s=5.0 if ok else 0.0)
        results.close()
    return [outputs[r] for r in range(world_size)]


def _warm_imports() -> None:
    """Import heavy torch.distributed modules once in the parent so forked workers share them.

    DeviceMesh slicing, FSDP/DTensor and the optimizers pull in torch.distributed.tensor and
    torch._dynamo (seconds of import work each); without this every worker repeats it,
    which on 2 cores costs ~10 s per test.
    """
    import torch._dynamo  # DeviceMesh slicing and optimizer.step() import it lazily
    import torch.distributed.device_mesh
    import torch.distributed.tensor  # noqa: F401


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _check_dead(procs: list[Any], outputs: dict[int, Any], results: Any) -> None:
    """Raise if a worker exited without reporting (segfault, os._exit, OOM kill)."""
    for rank, p in enumerate(procs):
        if rank in outputs or p.is_alive():
            continue
        # It may have reported just before exiting: give the queue one more look.
        try:
            r, status, payload = results.get(timeout=0.5)
        except queue.Empty:
            raise MultiprocessError(
                f"rank {rank} exited with code {p.exitcode} without returning a result"
            ) from None
        if status == "error":
            raise _failure(None, len(procs), {r: payload}, results)
        outputs[r] = pickle.loads(payload)
        return


def _failure(
    fn: Callable[..., Any] | None,
    world_size: int,
    errors: dict[int, tuple[float, str]],
    results: Any,
    grace_s: float = 2.0,
) -> MultiprocessError:
    """The error for the rank that failed first, after a short wait for other ranks' reports.

    One rank's exception makes its peers fail in their collectives right after; the
    earliest timestamp is the root cause, the rest are listed by their last line.
    """
    end = time.monotonic() + grace_s
    while len(errors) < world_size and time.monotonic() < end:
        try:
            rank, status, payload = results.get(timeout=0.05)
        except queue.Empty:
            continue
        if status == "error":
            errors[rank] = payload
    first = min(errors, key=lambda r: errors[r][0])
    where = f" in {_name(fn)}" if fn is not None else ""
    msg = f"rank {first} of {world_size} failed{where}:\n{errors[first][1]}"
    others = sorted(r for r in errors if r != first)
    if others:
        msg += "\nthen (likely as a consequence):\n" + "\n".join(
            f"  rank {r}: {errors[r][1].strip().splitlines()[-1]}" for r in others
        )
    return MultiprocessError(msg)


def _stop(procs: list[Any], grace_s: float) -> None:
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()

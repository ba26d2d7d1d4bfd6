"""Process-group setup from torchrun's environment."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from longboat.core.device import Accelerator, get_accelerator


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node (selects the device)."""
    world_size: int
    """Total number of processes."""
    backend: str
    """torch.distributed backend in use ("" when running as a single process)."""

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that logs and prints)."""
        return self.rank == 0


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {name}={raw!r} is not an int (set by torchrun)"
        ) from None


_JOIN = "longboat/join/"
"""Store keys of the handshake by which the ranks of one launch agree on their prefix."""
_POLL_S = 0.02

_launch_prefix: str | None = None


def launch_store_prefix() -> str | None:
    """The store prefix of this launch's process groups (``init_distributed``), or None when
    they were not made by it. Other keys a launch puts in the job's store (the watchdog's)
    go under it, so nothing an earlier attempt wrote is read as this one's."""
    return _launch_prefix


def join_launch(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """A store prefix that every rank of this launch gets and no earlier launch used.

    torchrun's agent hosts one store for the whole job and starts each attempt's ranks
    against it (``--max-restarts``, a node that rejoins), so the keys an earlier attempt's
    process groups wrote are still there under the same names: a new rank that reads a peer's
    address before that peer wrote its own connects to a process that is gone (gloo's
    connectFullMesh: "Connection refused", or a wait until the timeout), and a store-based
    barrier counts the old ranks. ``TORCHELASTIC_RESTART_COUNT`` is no generation: each agent
    counts its own restarts (a replaced node's starts at 0). So the ranks agree on a fresh
    one: every rank but 0 posts a fresh nonce under its rank number; rank 0 answers each nonce
    it reads with a fresh generation until every rank has confirmed under that generation (a
    stale nonce gets an answer that nobody reads). Raises ``RuntimeError`` naming the ranks
    that did not join within ``timeout``.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        generation = uuid.uuid4().hex
        answered: dict[int, bytes] = {}
        pending = list(range(1, world_size))
        while pending:
            for r in list(pending):
                if store.check([f"{_JOIN}{generation}/ready/{r}"]):
                    pending.remove(r)
                elif store.check([f"{_JOIN}ask/{r}"]):
                    nonce = store.get(f"{_JOIN}ask/{r}")
                    if answered.get(r) != nonce:
                        store.set(f"{_JOIN}answer/{nonce.decode()}", generation)
                        answered[r] = nonce
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank(s) {pending} of {world_size} did not join the process group within "
                    f"{timeout.total_seconds():g}s; check their logs (a rank that failed to start)"
                )
            if pending:
                time.sleep(_POLL_S)
    else:
        nonce = uuid.uuid4().hex
        answer = f"{_JOIN}answer/{nonce}"
        store.set(f"{_JOIN}ask/{rank}", nonce)
        try:
            store.wait([answer], timeout)
        except (RuntimeError, dist.DistError) as exc:  # DistStoreError on the timeout
            raise RuntimeError(
                f"rank {rank}: rank 0 did not admit it to the process group within "
                f"{timeout.total_seconds():g}s ({exc}); check rank 0's log"
            ) from None
        generation = store.get(answer).decode()
        store.delete_key(answer)
        store.set(f"{_JOIN}{generation}/ready/{rank}", "1")
    return f"longboat/{generation}/"


def init_distributed(
    accelerator: Accelerator | None = None,
    *,
    timeout: timedelta | float = timedelta(minutes=10),
) -> DistInfo:
    """Initialise torch.distributed from torchrun's env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    Binds this process to its local device first. Without those variables the
    process runs alone and no process group is created. If a group already
    exists (e.g. under ``run_multiprocess``) it is reused. ``timeout`` (seconds or a
    timedelta): how long joining the group and a collective wait for a peer; generous, as
    ranks start at different times and rank 0 may prepare data while the others wait. The
    trainer narrows it to ``train.collective_timeout_s`` for the steps
    (``set_collective_timeout``). The group's keys go under a prefix that the ranks of this
    launch agree on first (``join_launch``): an attempt that torchrun's agent restarts on the
    job's store never reads what an earlier attempt left there.
    """
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    acc = accelerator or get_accelerator()
    if dist.is_available() and dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        acc.set_device(local_rank)
        return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), dist.get_backend())
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        acc.set_device(0)
        return DistInfo(rank=0, local_rank=0, world_size=1, backend="")
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not. "
            "Fix: launch with torchrun (it sets all of them) or export the missing variables."
        )
    acc.set_device(local_rank)
    backend = acc.dist_backend
    kwargs = {}
    if acc.device_type != "cpu":
        # Binding the group to the device lets NCCL-like backends connect eagerly.
        kwargs["device_id"] = acc.device(local_rank)
    global _launch_prefix
    # The job's store as torch's env:// rendezvous makes it (a client of torchrun's agent
    # store, or hosted by rank 0), under a prefix of this launch alone (``join_launch``).
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    prefix = join_launch(store, rank, world_size, timeout)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **kwargs,
    )
    _launch_prefix = prefix
    return DistInfo(rank, local_rank, world_size, backend)


def set_collective_timeout(seconds: float) -> None:
    """Make every existing process group (the default one and those built from it: megatron's,
    a DeviceMesh's) give up on a collective after ``seconds``; groups made with their own
    default (30 minutes for gloo) would otherwise outwait ``train.collective_timeout_s``."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed import distributed_c10d as c10d

    set_timeout = getattr(dist, "set_timeout", None) or getattr(c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    timeout = timedelta(seconds=float(seconds))
    for group in list(c10d._world.pg_map):
        try:
            set_timeout(timeout, group)
        except (RuntimeError, ValueError):  # a backend without a settable timeout
            continue


def destroy_distributed() -> None:
    """Tear down the default process group if one exists (safe to call twice)."""
    global _launch_prefix
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _launch_prefix = None


def single_process_group(accelerator: Accelerator) -> bool:
    """A world-size-1 process group when none exists (a run not launched by torchrun, for
    code that needs process groups, e.g. megatron); returns whether it made one (the caller
    destroys it then)."""
    if dist.is_initialized():
        return False
    from longboat.core.distributed.multiprocess import find_free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(find_free_port())
    dist.init_process_group(accelerator.dist_backend, rank=0, world_size=1)
    return True


def check_precision_hardware(precision: str, accelerator: Accelerator) -> None:
    """``ConfigError`` naming ``train.precision`` and the device where ``precision`` is
    ``fp8`` and the accelerator has no FP8 matmuls (CPU, CUDA before compute capability 8.9)."""
    if precision == "fp8" and not accelerator.supports_fp8:
        from longboat.core.config.errors import ConfigError

        raise ConfigError(
            f"needs FP8 matmuls, which this accelerator ({accelerator.device_name()}) does "
            "not have: FP8 GEMMs run on CUDA GPUs of compute capability 8.9 or newer (Ada, "
            "Hopper and later)",
            key="train.precision",
            value=precision,
            fix="train on such a GPU, or use train.precision=bf16",
        )


def split_fp8(precision: str, recipe: str) -> tuple[str, str | None]:
    """``(the weights' precision, the FP8 recipe)`` of a run that trains in ``precision``
    (``run_precision``'s answer) with ``train.fp8.recipe`` ``recipe``: ``fp8`` is bf16 weights
    whose linears run their GEMMs in FP8 with the recipe; any other precision has no recipe.
    Every stack that trains in FP8 reads its precision through this."""
    return ("bf16", recipe) if precision == "fp8" else (precision, None)


def run_precision(precision: str, cpu_precision: str, accelerator: Accelerator) -> str:
    """The precision a run trains in: ``cpu_precision`` on CPU, fp32 where bf16 is asked for
    but the accelerator lacks it, else ``precision``; ``fp8`` where the accelerator has no
    FP8 matmuls is a ``ConfigError`` (``check_precision_hardware``), not a fallback."""
    check_precision_hardware(precision, accelerator)
    if accelerator.device_type == "cpu":
        return cpu_precision
    if precision == "bf16" and not accelerator.supports_bf16:
        return "fp32"
    return precision

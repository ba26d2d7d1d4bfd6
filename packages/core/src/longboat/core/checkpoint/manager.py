"""CheckpointManager: sharded DCP checkpoints that are never half-valid.

Layout under ``cfg.dir``::

    step_00000100/
        .metadata, __0_0.distcp, __1_0.distcp, ...   # DCP shards (modules, optimizers)
        extra_rank0.pt, extra_rank1.pt, ...           # per-rank non-tensor state
        manifest.json                                 # written last: step, config, sha256s

A save writes into ``.tmp-step_XXXXXXXX-<nonce>/``, writes the manifest last,
then renames the folder into place, so a crash at any point leaves either the
complete checkpoint or an ignored temp folder. Old checkpoints are pruned only
after a save succeeded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import pickle
import re
import secrets
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from longboat.core.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWarning,
    InvalidCheckpointError,
)
from longboat.core.checkpoint.manifest import (
    Manifest,
    build_manifest,
    fsync_dir,
    read_manifest,
    verify_files,
    write_manifest,
)
from longboat.core.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
from longboat.core.checkpoint.state import (
    apply_extras,
    load_sharded,
    serialize_extras,
    sharded_templates,
    split_state,
)

__all__ = ["TEST_PAUSE_AT_ENV", "TEST_PAUSE_ENV", "CheckpointManager", "step_dir_name"]

logger = logging.getLogger(__name__)

TEST_PAUSE_ENV = "LONGBOAT_CKPT_TEST_PAUSE_S"
"""Test hook: seconds a save sleeps after writing a file group (kill-mid-save tests)."""
TEST_PAUSE_AT_ENV = "LONGBOAT_CKPT_TEST_PAUSE_AT"
"""Test hook: pause only at this point: ``extras``, ``shards`` or ``manifest`` (default: all)."""

# DCP warns on every single-process save/load; single process is a supported mode here.
_SINGLE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?(unavailable|uninitialized)"
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        yield


_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


def step_dir_name(step: int) -> str:
    """``step_00000042`` for step 42."""
    return f"step_{step:08d}"


def _test_pause(point: str) -> None:
    seconds = os.environ.get(TEST_PAUSE_ENV)
    at = os.environ.get(TEST_PAUSE_AT_ENV)
    if seconds and at in (None, "", point):
        logger.warning("checkpoint test hook: pausing %ss at %s", seconds, point)
        time.sleep(float(seconds))


def _jsonable(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    else:
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(config, DictConfig):
                config = OmegaConf.to_container(config, resolve=True)
        except ImportError:  # pragma: no cover - omegaconf is a core dependency
            pass
    if not isinstance(config, dict):
        raise TypeError(f"config_dict must be a dict, dataclass or DictConfig, got {type(config)}")
    return json.loads(json.dumps(config, default=str))


def _dcp_failure(what: str, exc: CheckpointException) -> CheckpointError:
    """DCP raises a BaseException subclass; turn it into a plain error naming the cause
    (the first line of the first rank's error, and which ranks failed)."""
    ranks = sorted(exc.failures)
    first = str(exc.failures[ranks[0]][0]).strip().splitlines()
    cause = first[0] if first else type(exc.failures[ranks[0]][0]).__name__
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return CheckpointError(f"{what} failed on {where}: {cause}")


def _tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor in a nested state dict (what a save writes, give or take)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _save_failure(exc: BaseException, directory: Path, final: Path, needed: int) -> BaseException:
    """An OS error of a save (a full disk above all) as one ``CheckpointError`` naming the
    checkpoint folder and the space needed and free; anything else unchanged."""
    if isinstance(exc, CheckpointException):
        causes = [exc.failures[r][0] for r in sorted(exc.failures)]
        full = [c for c in causes if isinstance(c, OSError) and c.errno in _NO_SPACE]
        exc = full[0] if full else _dcp_failure(f"writing shards of {final}", exc)
    if not isinstance(exc, OSError):
        return exc
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = -1
    space = f"{_mb(free)} free" if free >= 0 else "free space unknown"
    kept = _checkpoints_in(directory)
    intact = (
        f"the previous checkpoint {kept[-1][1]} is intact"
        if kept
        else "no earlier checkpoint exists there"
    )
    if exc.errno in _NO_SPACE:
        return CheckpointError(
            f"saving checkpoint {final} failed: no space left on the device of {directory} "
            f"(about {_mb(needed)} needed, {space}); {intact}. Fix: free space there or set "
            "checkpoint.dir to a folder on a larger disk (checkpoint.keep_last bounds how many "
            "checkpoints are kept)"
        )
    where = f" ({exc.filename})" if exc.filename else ""
    return CheckpointError(
        f"saving checkpoint {final} failed: {exc.strerror or exc}{where}; {intact}. Fix: make "
        f"{directory} writable or set checkpoint.dir to another folder"
    )


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


_UNSUPPORTED_GLOBAL = re.compile(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)")


def _load_extras(path: Path) -> dict[str, Any]:
    """``torch.load`` of a per-rank state file, weights only; a file holding anything else
    (code, foreign classes) or unreadable is refused naming the file."""
    try:
        extras = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError) as exc:
        found = _UNSUPPORTED_GLOBAL.search(str(exc))
        what = f"references {found.group(1)}, which" if found else "holds data that"
        raise CheckpointCorruptError(
            f"{path} {what} a longboat checkpoint never contains (only tensors, numbers, "
            "strings, lists, tuples and dicts); it is damaged or was crafted, and is not loaded"
        ) from None
    if not isinstance(extras, dict):
        raise CheckpointCorruptError(
            f"{path} holds a {type(extras).__name__}, not the dict of per-rank state a "
            "checkpoint writes; it is damaged or was crafted, and is not loaded"
        )
    return extras


def _checkpoints_in(directory: Path) -> list[tuple[int, Path]]:
    """Finished checkpoints (readable manifest) in ``directory``, oldest first; no warnings."""
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.iterdir()):
        match = _STEP_RE.match(path.name)
        if match and path.is_dir():
            try:
                found.append((read_manifest(path).step, path))
            except InvalidCheckpointError:
                continue
    return found


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


class _PendingSave:
    """An async save in flight: DCP future plus rank 0's finalisation."""

    def __init__(self, step: int, final: Path) -> None:
        self.step = step
        self.final = final
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None


class CheckpointManager:
    """Save, find and load sharded checkpoints under ``cfg.dir``.

    Works in a single process (no process group) and under torch.distributed;
    every rank must call ``save``/``load``/``wait``/``close`` together.

    Args:
        cfg: a ``CheckpointConfig`` (dir, keep_last, async_save, resume, ...).
        config_dict: the run's resolved config, stored in each manifest.
        verify_on_load: check every file's sha256 before loading.
    """

    def __init__(self, cfg: Any, config_dict: Any = None, *, verify_on_load: bool = True) -> None:
        if int(cfg.keep_last) < 0:
            raise ValueError(
                f"checkpoint.keep_last={cfg.keep_last} must be >= 0 (0 keeps every checkpoint)"
            )
        self.cfg = cfg
        self.dir = Path(str(cfg.dir)).expanduser()
        self.config_dict = _jsonable(config_dict)
        self.verify_on_load = verify_on_load
        self._pending: _PendingSave | None = None
        self._async_pg: Any = None
        self.last_saved_step: int | None = None
        self.last_loaded: Path | None = None
        """The checkpoint the latest ``load``/``resume`` read."""

    # --- distributed helpers ---------------------------------------------------------

    @staticmethod
    def _rank() -> int:
        return dist.get_rank() if _dist_on() else 0

    @staticmethod
    def _world() -> int:
        return dist.get_world_size() if _dist_on() else 1

    @staticmethod
    def _broadcast(obj: Any) -> Any:
        if not _dist_on():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @staticmethod
    def _raise_if_any(error: BaseException | None, what: str) -> None:
        """Every rank raises if any rank failed (so no rank waits forever in a collective)."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        if _dist_on():
            messages: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(messages, message)
        else:
            messages = [message]
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if not failed:
            return
        if error is not None:
            raise error
        rank, msg = failed[0]
        cls = CheckpointCorruptError if "CheckpointCorruptError" in msg else CheckpointError
        raise cls(f"{what} failed on rank {rank}: {msg}")

    # --- discovery ---------------------------------------------------------------------

    def checkpoints(self, *, warn: bool = True) -> list[tuple[int, Path]]:
        """Finished checkpoints as (step, path), oldest first; others skipped with a warning."""
        if not self.dir.is_dir():
            return []
        found = []
        for path in sorted(self.dir.iterdir()):
            if not path.is_dir():
                continue
            if path.name.startswith(_TMP_PREFIX):
                if warn and (self._pending is None or self._pending.final.name not in path.name):
                    warnings.warn(
                        f"ignoring unfinished checkpoint {path} (a save was interrupted before "
                        "its manifest was written); it is removed after the next successful save",
                        CheckpointWarning,
                        stacklevel=3,
                    )
                continue
            match = _STEP_RE.match(path.name)
            if not match:
                continue
            try:
                manifest = read_manifest(path)
            except InvalidCheckpointError as exc:
                if warn:
                    warnings.warn(
                        f"ignoring checkpoint {path}: {exc}", CheckpointWarning, stacklevel=3
                    )
                continue
            if manifest.step != int(match.group(1)):
                if warn:
                    warnings.warn(
                        f"ignoring checkpoint {path}: its manifest says step {manifest.step}",
                        CheckpointWarning,
                        stacklevel=3,
                    )
                continue
            found.append((manifest.step, path))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest finished checkpoint (valid manifest), or None."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    def should_save(self, step: int) -> bool:
        """True every ``cfg.every_steps`` steps (never when it is 0)."""
        every = int(self.cfg.every_steps)
        return every > 0 and step > 0 and step % every == 0

    # --- save --------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, async_save: bool | None = None) -> Path:
        """Write ``state`` as checkpoint ``step``; returns its final path.

        Values of ``state``: ``nn.Module`` and ``Optimizer`` (sharded by DCP),
        anything with ``state_dict``/``load_state_dict``, or plain values.
        With async save the state is copied now and written in the background;
        the checkpoint appears when the write finishes.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self.wait()
        use_async = bool(self.cfg.async_save) if async_save is None else async_save
        rank, world = self._rank(), self._world()
        final = self.dir / step_dir_name(step)

        nonce = self._broadcast(secrets.token_hex(4) if rank == 0 else None)
        tmp = self.dir / f"{_TMP_PREFIX}{final.name}-{nonce}"
        error: BaseException | None = None
        if rank == 0:
            try:
                tmp.mkdir(parents=True, exist_ok=False)
            except OSError as exc:
                error = CheckpointError(f"cannot create {tmp}: {exc}")
        self._raise_if_any(error, "creating the checkpoint folder")

        needed = 0
        try:
            split = split_state(state)
            try:
                data = serialize_extras(split.extras)
                # Global tensor sizes (DTensors report theirs; replicas are written once).
                needed = _tensor_bytes(split.sharded) + len(data) * world
                _write_file(tmp / f"extra_rank{rank}.pt", data)
            except BaseException as exc:
                error = _save_failure(exc, self.dir, final, needed)
            self._raise_if_any(error, "writing per-rank state")
            _test_pause("extras")

            writer = FileSystemWriter(tmp, sync_files=True)
            if not use_async:
                try:
                    with _quiet_single_process():
                        dcp.save(split.sharded, storage_writer=writer)
                except CheckpointException as exc:
                    error = _save_failure(exc, self.dir, final, needed)
                    raise error from None
                _test_pause("shards")
                if rank == 0:
                    try:
                        self._finalize(step, tmp, final, world)
                    except BaseException as exc:
                        error = _save_failure(exc, self.dir, final, needed)
                self._raise_if_any(error, f"finalising checkpoint {final}")
                self.last_saved_step = step
                return final

            if _dist_on() and self._async_pg is None:
                # Background collectives must not interleave with training's on one group.
                self._async_pg = dist.new_group(backend="gloo")
            response = dcp.async_save(
                split.sharded, storage_writer=writer, process_group=self._async_pg
            )
            future = getattr(response, "upload_completion", response)
            pending = _PendingSave(step, final)

            def finish() -> None:
                try:
                    future.result()
                    _test_pause("shards")
                    if rank == 0:
                        self._finalize(step, tmp, final, world)
                except BaseException as exc:
                    pending.error = _save_failure(exc, self.dir, final, needed)
                if pending.error is not None and rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)

            pending.thread = threading.Thread(target=finish, name=f"ckpt-save-{step}", daemon=True)
            pending.thread.start()
        except BaseException:
            # A failed save leaves nothing behind (a killed one leaves a temp folder that
            # is ignored and removed after the next successful save).
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._pending = pending
        return final

    def _finalize(self, step: int, tmp: Path, final: Path, world: int) -> None:
        """Rank 0: checksums + manifest, atomic rename, then prune."""
        t0 = time.perf_counter()
        manifest = build_manifest(tmp, step=step, world_size=world, config=self.config_dict)
        _test_pause("manifest")
        write_manifest(tmp, manifest)
        trash = None
        if final.exists():  # re-save of the same step: swap, never delete before the rename
            trash = self.dir / f"{_TRASH_PREFIX}{final.name}-{secrets.token_hex(4)}"
            os.rename(final, trash)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        size_mb = sum(info["bytes"] for info in manifest.files.values()) / 2**20
        logger.info(
            "saved checkpoint %s (%.1f MB, finalised in %.2fs)",
            final,
            size_mb,
            time.perf_counter() - t0,
        )
        self._prune(keep=final)

    def _prune(self, keep: Path) -> None:
        """Keep the newest ``keep_last`` finished checkpoints; drop leftovers of crashed saves."""
        for path in self.dir.iterdir():
            if path.is_dir() and path.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                logger.info("removing leftover of an interrupted save: %s", path)
                shutil.rmtree(path, ignore_errors=True)
        keep_last = int(self.cfg.keep_last)
        if keep_last <= 0:
            return
        found = self.checkpoints(warn=False)
        for _, path in found[: max(0, len(found) - keep_last)]:
            if path == keep:
                continue
            # Rename first: a half-deleted folder must never look like a checkpoint.
            trash = self.dir / f"{_TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}"
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
            logger.info("pruned checkpoint %s (keep_last=%d)", path, keep_last)

    def wait(self) -> None:
        """Block until an async save in flight is finished (and raise if it failed)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        assert pending.thread is not None
        pending.thread.join()
        self._raise_if_any(pending.error, f"async save of {pending.final}")
        if _dist_on():
            dist.barrier()  # rank 0's rename is visible to every rank from here on
        self.last_saved_step = pending.step

    def close(self) -> None:
        """Finish any pending async save."""
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- load --------------------------------------------------------------------------

    def resume(
        self, state: dict[str, Any], *, before_load: Callable[[Path, Manifest], None] | None = None
    ) -> int | None:
        """Load as ``cfg.resume`` says: ``auto`` (latest, if any), ``none``, or a path.

        ``auto`` falls back to the newest intact checkpoint when a newer one is damaged (a
        truncated or missing file, a checksum mismatch), with a warning naming both; when
        every checkpoint is damaged it raises ``CheckpointCorruptError``. An explicit path
        that is damaged raises ``CheckpointCorruptError`` naming the file and the override
        that loads the previous checkpoint. ``before_load(path, manifest)`` runs before a
        checkpoint is read (a compatibility check may raise there).
        """
        how = str(self.cfg.resume)
        if how == "none":
            return None
        if how == "auto":
            return self._resume_latest(state, before_load)
        path = Path(how).expanduser()
        if not path.is_dir():
            raise CheckpointError(
                f"checkpoint.resume={how!r} is not a folder; use 'auto', 'none' or the path of a "
                f"step_XXXXXXXX folder (finished ones in {self.dir}: "
                f"{[p.name for _, p in self.checkpoints(warn=False)]})"
            )
        try:
            if before_load is not None:
                before_load(path, read_manifest(path))
            return self.load(state, path)
        except (CheckpointCorruptError, InvalidCheckpointError) as exc:
            older = [p for _, p in self.checkpoints(warn=False) if p.name < path.name]
            older += [p for _, p in _checkpoints_in(path.parent) if p.name < path.name]
            fix = (
                f"Fix: restore the file, or load the previous checkpoint with "
                f"checkpoint.resume={max(older, key=lambda p: p.name)}"
                if older
                else "Fix: restore the file, or start over with checkpoint.resume=none"
            )
            raise type(exc)(f"{exc}. {fix}") from None

    def _resume_latest(
        self, state: dict[str, Any], before_load: Callable[[Path, Manifest], None] | None
    ) -> int | None:
        found = self.checkpoints() if self._rank() == 0 else None
        found = [(s, Path(p)) for s, p in self._broadcast([(s, str(p)) for s, p in found or []])]
        damaged: list[str] = []
        for i in range(len(found) - 1, -1, -1):
            path = found[i][1]
            manifest = read_manifest(path)
            if before_load is not None:
                before_load(path, manifest)
            try:
                return self.load(state, path)
            except CheckpointCorruptError as exc:
                damaged.append(f"{path.name}: {exc}")
                aside = self._set_aside_damaged(path)
                if i > 0:
                    warnings.warn(
                        f"checkpoint {path} is damaged ({exc}); it is set aside as {aside.name} "
                        f"and the run resumes from the previous one, {found[i - 1][1]}",
                        CheckpointWarning,
                        stacklevel=3,
                    )
        if damaged:
            raise CheckpointCorruptError(
                f"every checkpoint in {self.dir} is damaged and set aside as <name>.damaged "
                f"({'; '.join(damaged)}). Fix: restore the files, or start over with "
                "checkpoint.resume=none"
            )
        return None

    def _set_aside_damaged(self, path: Path) -> Path:
        """Rename a damaged checkpoint to ``<name>.damaged`` (never loaded, never pruned)."""
        aside = path.with_name(f"{path.name}.damaged")
        if self._rank() == 0:
            n = 1
            while aside.exists():
                n += 1
                aside = path.with_name(f"{path.name}.damaged{n}")
            os.rename(path, aside)
        aside = Path(self._broadcast(str(aside)))
        if _dist_on():
            dist.barrier()
        return aside

    def load(
        self, state: dict[str, Any], path: str | Path | None = None, *, strict: bool = True
    ) -> int | None:
        """Load checkpoint ``path`` (default: the latest finished one) into ``state`` in place.

        Returns the checkpoint's step, or None when ``path`` is None and there is
        no checkpoint yet. Modules and optimizers are resharded to the current
        world size. Plain (non-stateful) values are replaced in ``state``.
        """
        self.wait()
        rank, world = self._rank(), self._world()
        if path is None:
            chosen = self.latest() if rank == 0 else None
            chosen = self._broadcast(None if chosen is None else str(chosen))
            if chosen is None:
                return None
            path = chosen
        path = Path(path)
        manifest = read_manifest(path)  # raises InvalidCheckpointError naming the folder

        error: BaseException | None = None
        if self.verify_on_load:
            try:
                verify_files(path, manifest, sorted(manifest.files)[rank::world])
            except CheckpointCorruptError as exc:
                error = exc
            self._raise_if_any(error, f"verifying {path}")

        templates = sharded_templates(state)
        if templates:
            try:
                with _quiet_single_process():
                    dcp.load(
                        templates,
                        storage_reader=SafeFileSystemReader(path),
                        planner=SafeLoadPlanner(allow_partial_load=not strict),
                    )
            except CheckpointException as exc:
                raise _dcp_failure(f"loading {path}", exc) from None
            load_sharded(state, templates)

        extra_rank = rank
        if rank >= manifest.world_size:
            warnings.warn(
                f"{path} was saved by {manifest.world_size} ranks; rank {rank} takes rank 0's "
                "non-tensor state (RNG streams now repeat across ranks)",
                CheckpointWarning,
                stacklevel=2,
            )
            extra_rank = 0
        extras = _load_extras(path / f"extra_rank{extra_rank}.pt")
        apply_extras(state, extras, strict=strict)
        self.last_loaded = path
        logger.info("loaded checkpoint %s (step %d)", path, manifest.step)
        return manifest.step

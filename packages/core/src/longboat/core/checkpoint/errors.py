"""Checkpoint error and warning types."""

from __future__ import annotations

from longboat.core.errors import UserError

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointWarning",
    "InvalidCheckpointError",
]


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be saved or loaded."""


class InvalidCheckpointError(CheckpointError):
    """A folder is not a finished checkpoint (missing or unreadable manifest)."""


class CheckpointCorruptError(CheckpointError):
    """A file of a finished checkpoint does not match its manifest checksum."""


class CheckpointWarning(UserWarning):
    """An unfinished or damaged checkpoint was skipped."""

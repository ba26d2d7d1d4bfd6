"""Errors of multimodal data: each names the input file, the row and the field at fault.

All are ``UserError`` s (the command line prints the message and exits 2) and
``ValueError`` s (what the llm stack's ``data`` commands map to exit 2 too).
"""

from __future__ import annotations

from longboat.core.errors import UserError

__all__ = [
    "BadMediaError",
    "DataError",
    "PlaceholderCountError",
    "SampleTooLongError",
    "where",
]


def where(source: str, row: int, line: int | None = None) -> str:
    """``"<source> row <row>"`` (0-based row), plus ``(line <n>)`` for JSON lines input."""
    return f"{source} row {row}" + (f" (line {line})" if line is not None else "")


class DataError(UserError, ValueError):
    """A problem with the training data; the message says where it is and how to fix it."""


class BadMediaError(DataError):
    """A missing, unreadable or corrupt image / video of one sample.

    Skippable: with ``skip_bad_samples=True`` the sample is dropped and counted instead.
    """

    def __init__(self, at: str, field: str, file: str, problem: str) -> None:
        self.at, self.field, self.file, self.problem = at, field, file, problem
        super().__init__(
            f"{at}: field {field!r}: {file}: {problem}. Fix the file or the record, or set "
            "data.skip_bad_samples=true to skip such samples (they are counted)"
        )


class PlaceholderCountError(DataError):
    """The ``<image>`` / ``<video>`` placeholders of a sample do not match its media."""


class SampleTooLongError(DataError):
    """A sample does not fit in one packed row and cannot be cut without splitting an image."""

"""Errors of latent datasets and their preparation: each names the file and sample at fault.

Both are ``UserError`` s (the command line prints the message and exits 2, no traceback) and
``ValueError`` s.
"""

from __future__ import annotations

from longboat.core.errors import UserError

__all__ = ["BadSampleError", "DataError"]


class DataError(UserError, ValueError):
    """A problem with a latent dataset or its inputs; the message says where and how to fix it."""


class BadSampleError(DataError):
    """One input sample cannot be used: a missing, unreadable or corrupt video / image, or a
    missing caption. ``prepare`` with ``skip_bad_samples=true`` skips and counts it instead."""

    def __init__(self, file: str, problem: str) -> None:
        self.file, self.problem = file, problem
        super().__init__(
            f"{file}: {problem}. Fix or remove the file, or set skip_bad_samples=true to skip "
            "such samples (they are counted)"
        )

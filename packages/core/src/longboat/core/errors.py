"""The base of every error a user can fix: printed as one message, no traceback.

The command line catches ``UserError`` (bad config, a damaged or mismatched checkpoint, a
broken dataset, a diverging run), prints its message on rank 0 and exits with
``exit_code``; ``--debug`` shows the traceback instead. Anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """An expected failure whose message says what is wrong and how to fix it."""

    exit_code: int = 2
    """Process exit status when the command line stops on this error."""


class RankFailure(UserError):
    """Another rank of a multi-process run failed: one line naming it and its last step
    (``longboat.core.distributed.watchdog``)."""

    exit_code = 3

    def __init__(self, message: str, *, report: bool) -> None:
        super().__init__(message)
        self.report = report
        """Whether this rank prints the line (the lowest surviving rank does)."""


__all__ = ["RankFailure", "UserError"]

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


__all__ = ["UserError"]

"""The one error type for every configuration problem.

A ``ConfigError`` carries one or more ``ConfigProblem`` s, so validation can
collect everything that is wrong and report it in a single message instead of
making the user fix one key per run. Each problem names the key path, the bad
value and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from longboat.core.errors import UserError


class _Unset:
    """Sentinel: a problem that has no single offending value."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config."""

    key: str | None
    """Full dotted key path (``parallel.tensor_parallel``), or None when not tied to a key."""
    message: str
    """What is wrong."""
    value: Any = UNSET
    """The offending value (UNSET when there is none, e.g. a missing key)."""
    fix: str | None = None
    """How to fix it."""

    def format(self) -> str:
        """One human-readable line: ``key=value: message. Fix: ...``."""
        head = ""
        if self.key is not None:
            head = self.key if self.value is UNSET else f"{self.key}={self.value!r}"
            head += ": "
        elif self.value is not UNSET:
            head = f"{self.value!r}: "
        text = head + self.message
        if self.fix:
            text += f" Fix: {self.fix}"
        return text


class ConfigError(UserError, ValueError):
    """Invalid configuration; carries every problem found.

    Construct either from one message (optionally with ``key``/``value``/``fix``)::

        raise ConfigError("must be positive", key="train.steps", value=-1, fix="set train.steps>0")

    or from a list of ``ConfigProblem`` collected during validation::

        raise ConfigError(problems)
    """

    def __init__(
        self,
        problems: str | ConfigProblem | Iterable[ConfigProblem],
        *,
        key: str | None = None,
        value: Any = UNSET,
        fix: str | None = None,
    ) -> None:
        if isinstance(problems, str):
            self.problems: list[ConfigProblem] = [
                ConfigProblem(key=key, message=problems, value=value, fix=fix)
            ]
        elif isinstance(problems, ConfigProblem):
            self.problems = [problems]
        else:
            self.problems = list(problems)
            if not self.problems:
                raise ValueError("ConfigError needs at least one problem")
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return "Invalid config: " + self.problems[0].format()
        lines = [f"Invalid config ({len(self.problems)} problems):"]
        lines += [f"  - {p.format()}" for p in self.problems]
        return "\n".join(lines)

    @property
    def keys(self) -> list[str | None]:
        """The key path of every problem, in order."""
        return [p.key for p in self.problems]


class ProblemCollector:
    """Accumulates problems; ``raise_if_any()`` turns them into one ConfigError."""

    def __init__(self) -> None:
        self.problems: list[ConfigProblem] = []

    def add(
        self, key: str | None, message: str, *, value: Any = UNSET, fix: str | None = None
    ) -> None:
        """Record one problem."""
        self.problems.append(ConfigProblem(key=key, message=message, value=value, fix=fix))

    def extend(self, error: ConfigError) -> None:
        """Absorb every problem of another ConfigError."""
        self.problems.extend(error.problems)

    def raise_if_any(self) -> None:
        """Raise one ConfigError holding everything collected, if anything was."""
        if self.problems:
            raise ConfigError(self.problems)


__all__ = ["UNSET", "ConfigError", "ConfigProblem", "ProblemCollector"]


def require_choice(value: Any, choices: Iterable[Any], *, key: str, what: str) -> None:
    """Raise ``ConfigError("unknown <what>", key=key, value=value, fix="use one of ...")``
    unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(
            f"unknown {what}",
            key=key,
            value=value,
            fix=f"use one of {', '.join(str(c) for c in choices)}",
        )

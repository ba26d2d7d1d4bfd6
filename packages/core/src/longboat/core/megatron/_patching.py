"""Reversible, version-checked patches of megatron-core call sites.

Two kinds of patch, both recorded in a ``PatchSet`` and undone in reverse order:

* ``set_attr``: replace a module global or class attribute (``torch`` in one
  megatron module, a helper function) and remember the old value.
* ``rewrite_code``: swap a function's ``__code__`` for one compiled from its own
  source with exact text replacements.  Swapping the code object (not the
  module attribute) also reaches callers that imported the function by name.
  Every replacement's original text must be present, so a megatron-core
  release that moved the call site fails loudly instead of silently running
  the CUDA path.
"""

from __future__ import annotations

import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class MegatronPatchError(RuntimeError):
    """A patch no longer matches the installed megatron-core source."""


@dataclass
class PatchSet:
    """An ordered record of applied patches that ``undo()`` reverts."""

    _undo: list[Callable[[], None]] = field(default_factory=list)

    def set_attr(self, obj: Any, name: str, value: Any, *, must_exist: bool = True) -> None:
        """Set ``obj.name = value`` remembering the previous value."""
        missing = object()
        old = getattr(obj, name, missing)
        if old is missing and must_exist:
            raise MegatronPatchError(
                f"{getattr(obj, '__name__', obj)!s} has no attribute {name!r}; the installed "
                "megatron-core does not match the version longboat's adapter was written for."
            )
        setattr(obj, name, value)
        if old is missing:
            self._undo.append(lambda: delattr(obj, name))
        else:
            self._undo.append(lambda: setattr(obj, name, old))

    def rewrite_code(self, func: Callable[..., Any], replacements: list[tuple[str, str]]) -> None:
        """Recompile ``func`` from its source with each ``(old, new)`` text replaced."""
        func = inspect.unwrap(getattr(func, "__func__", func))
        code = func.__code__
        source = textwrap.dedent(inspect.getsource(func))
        for old, new in replacements:
            if old not in source:
                raise MegatronPatchError(
                    f"{func.__module__}.{func.__qualname__}: expected call site {old!r} not found; "
                    "the installed megatron-core changed this function."
                )
            source = source.replace(old, new)
        new_code = _compile_like(source, func)
        func.__code__ = new_code
        self._undo.append(lambda: setattr(func, "__code__", code))

    def undo(self) -> None:
        """Revert every patch, newest first."""
        while self._undo:
            self._undo.pop()()


def _compile_like(source: str, func: types.FunctionType) -> types.CodeType:
    """Compile ``source`` (a def) so its code object can replace ``func.__code__``."""
    lines = source.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "async def "))
    )
    body = "\n".join(lines[start:])
    # Compile inside a class so zero-argument super() keeps its __class__ cell, and pad
    # with blank lines so tracebacks point at the real megatron line numbers.
    first = func.__code__.co_firstlineno
    padded = "\n" * max(first - 2, 0) + "class _Holder:\n" + textwrap.indent(body, "    ")
    namespace: dict[str, Any] = {}
    exec(
        compile(padded, inspect.getsourcefile(func) or "<megatron>", "exec"),
        func.__globals__,
        namespace,
    )
    new_code = namespace["_Holder"].__dict__[func.__name__].__code__
    if new_code.co_freevars != func.__code__.co_freevars:
        raise MegatronPatchError(
            f"{func.__qualname__}: rewritten code has free variables {new_code.co_freevars}, "
            f"expected {func.__code__.co_freevars}."
        )
    return new_code

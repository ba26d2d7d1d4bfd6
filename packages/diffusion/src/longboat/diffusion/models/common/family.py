"""The lazy attributes of a family module's ``__init__``: the config names import no megatron,
the rest load the family's ``model.py`` / ``diffusers.py`` on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(module: str, lazy: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module`` that imports ``lazy[name]`` (a module path) and
    returns its ``name`` on first access; ``AttributeError`` for other names."""

    def getattr_(name: str) -> Any:
        if name in lazy:
            return getattr(importlib.import_module(lazy[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return getattr_


__all__ = ["lazy_attributes"]

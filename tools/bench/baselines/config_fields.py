"""Reference shapes read from a longboat model config: each field names the key it mirrors."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any


def from_cfg(path: str, **field: Any) -> Any:
    """A dataclass field that ``read_shapes`` fills from the config's dotted ``path``."""
    return dataclasses.field(metadata={"cfg": path}, **field)


def read_shapes(cls: Any, cfg: Any, **computed: Any) -> Any:
    """``cls`` with every ``from_cfg`` field read from ``cfg`` (duck-typed), plus ``computed``."""
    fields = [f for f in dataclasses.fields(cls) if "cfg" in f.metadata]
    return cls(**{f.name: operator.attrgetter(f.metadata["cfg"])(cfg) for f in fields}, **computed)

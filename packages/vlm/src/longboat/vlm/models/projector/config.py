"""Projector configuration (pure Python): the run config's ``model.projector`` section."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from longboat.core.config.errors import ConfigError

PROJECTORS = ("mlp2x_gelu",)
"""Implemented projector kinds: ``mlp2x_gelu`` is Linear -> GELU -> Linear (LLaVA's)."""


@dataclass(frozen=True, kw_only=True)
class ProjectorConfig:
    """A projector: its kind, its widths (``None``: taken from the tower / the decoder) and
    whether its linears carry biases."""

    name: str = "mlp2x_gelu"
    """Kind, one of ``PROJECTORS``."""
    input_size: int | None = None
    """Width of the features it reads; ``None``: the vision tower's ``hidden_size``."""
    output_size: int | None = None
    """Width it writes (= the decoder's ``hidden_size``); ``None``: the decoder's."""
    hidden_act: str = "gelu"
    """Activation between the two linears (``gelu``: exact erf GELU)."""
    bias: bool = True
    """Bias on both linears."""

    def resolved(self, vision_width: int, decoder_width: int) -> ProjectorConfig:
        """A copy with ``input_size`` / ``output_size`` filled where they were ``None``."""
        return dataclasses.replace(
            self,
            input_size=vision_width if self.input_size is None else self.input_size,
            output_size=decoder_width if self.output_size is None else self.output_size,
        )

    def validate(self, *, prefix: str = "model.projector") -> None:
        """Raise ``ConfigError`` naming a bad key."""
        if self.name not in PROJECTORS:
            raise ConfigError(
                f"{prefix}.name={self.name!r}: unknown projector", fix=f"use one of {PROJECTORS}"
            )
        if self.hidden_act != "gelu":
            raise ConfigError(
                f"{prefix}.hidden_act={self.hidden_act!r}: only 'gelu' is implemented"
            )

    @classmethod
    def from_mapping(
        cls, raw: Mapping[str, Any], *, base: ProjectorConfig | None = None,
        prefix: str = "model.projector",
    ) -> ProjectorConfig:  # fmt: skip
        """The config of a run's ``model.projector`` section (``base`` fills keys not given)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ConfigError(
                f"{', '.join(f'{prefix}.{k}' for k in unknown)}: unknown key(s)",
                fix=f"projectors take {sorted(names)}",
            )
        cfg = dataclasses.replace(base or cls(), **dict(raw))
        cfg.validate(prefix=prefix)
        return cfg

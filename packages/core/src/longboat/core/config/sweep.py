"""``--multirun``: one job per combination of swept override values, run one after another.

``optim.lr=1e-3,3e-3 train.seed=1,2`` gives four jobs (the Cartesian product, in order),
as Hydra's basic sweeper does; ``key=range(1,4)`` and ``key=choice(a,b)`` work too. Each
job trains in its own run directory, ``<output_dir>/multirun/<n>_<swept values>`` (``0_optim.lr-0.001``), so the
jobs never resume each other's checkpoints.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from longboat.core.config.errors import ConfigError


@dataclass(frozen=True)
class SweepJob:
    """One job of a sweep."""

    index: int
    """0-based position in the sweep."""
    overrides: list[str]
    """Every override of the job (swept ones with this job's value)."""
    swept: list[str]
    """The swept overrides with this job's values (``optim.lr=0.001``)."""

    @property
    def name(self) -> str:
        """Folder name of the job: ``<index>_<swept values>``."""
        slug = "_".join(self.swept) or "job"
        return f"{self.index}_{re.sub(r'[^A-Za-z0-9._+-]', '-', slug)}"


def expand_sweep(overrides: Sequence[str]) -> list[SweepJob]:
    """The jobs of a sweep over ``overrides``; ``ConfigError`` for a sweep it cannot expand."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    axes: list[list[tuple[str, bool]]] = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as exc:
            raise ConfigError(
                f"cannot parse override: {str(exc).splitlines()[0]}",
                value=text,
                fix="write overrides as key=value, key=a,b (a sweep), +key=value or ~key",
            ) from None
        if not override.is_sweep_override():
            axes.append([(text, False)])
            continue
        key = override.get_key_element()
        try:
            values = list(override.sweep_string_iterator())
        except (HydraException, ValueError, TypeError) as exc:
            raise ConfigError(
                f"cannot expand this sweep: {exc}",
                key=override.key_or_group,
                value=text,
                fix="list the values (key=a,b,c), or use range(start,stop) or choice(a,b)",
            ) from None
        axes.append([(f"{key}={v}", True) for v in values])
    jobs = []
    for i, combo in enumerate(itertools.product(*axes)):
        jobs.append(
            SweepJob(
                index=i,
                overrides=[text for text, _ in combo],
                swept=[text for text, swept in combo if swept],
            )
        )
    return jobs


__all__ = ["SweepJob", "expand_sweep"]

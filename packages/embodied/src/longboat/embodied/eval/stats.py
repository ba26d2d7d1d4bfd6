"""Success rates with a confidence interval: ``wilson_interval``.

The Wilson score interval keeps its coverage at the few episodes an evaluation runs and at
rates of 0 or 1, where the normal approximation collapses to a zero-width interval.
"""

from __future__ import annotations

import math

Z_95 = 1.959963984540054
"""The two-sided 95% quantile of the standard normal."""


def wilson_interval(successes: int, episodes: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval (lower, upper) of a success rate of ``successes`` out of
    ``episodes``; (0, 1) for no episode."""
    if not 0 <= successes <= episodes:
        raise ValueError(f"successes={successes} must be in [0, episodes={episodes}]")
    if episodes == 0:
        return 0.0, 1.0
    n, p = episodes, successes / episodes
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


__all__ = ["Z_95", "wilson_interval"]

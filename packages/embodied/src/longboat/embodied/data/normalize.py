"""Normalisation from dataset stats: mean/std, min/max and q01/q99 to [-1, 1], with inverse.

Every mode is an affine map per dimension, ``y = (x - offset) / scale``, so one (offset,
scale) pair per key covers whole-key modes and GR00T's modality.json joint groups (each group a
slice of a key with its own mode). ``min_max``/``q01_q99`` map [lo, hi] to [-1, 1]; values
outside are clipped when ``clip`` is set (as GR00T does), which the inverse cannot undo.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from longboat.embodied.data.layout import LeRobotFormatError

MODES = ("identity", "mean_std", "min_max", "q01_q99")
# LeRobot's NormalizationMode names and GR00T's mode names for the same maps.
ALIASES = {"quantiles": "q01_q99", "q99": "q01_q99"}
_MODALITY_SECTIONS = {"state": "observation.state", "action": "action"}


def _group_slices(modality: Mapping[str, Any] | None) -> dict[str, tuple[str, int, int]]:
    """``"state.arm" -> ("observation.state", start, end)`` for every modality.json group."""
    out: dict[str, tuple[str, int, int]] = {}
    for section, default_key in _MODALITY_SECTIONS.items():
        for name, spec in ((modality or {}).get(section) or {}).items():
            key = spec.get("original_key", default_key)
            out[f"{section}.{name}"] = (key, int(spec["start"]), int(spec["end"]))
    return out


class Normalizer:
    """Per-key affine normalisation built from stats; ``normalize``/``unnormalize`` tensors."""

    def __init__(
        self,
        stats: Mapping[str, Mapping[str, np.ndarray]],
        modes: Mapping[str, str],
        *,
        modality: Mapping[str, Any] | None = None,
        clip: bool = True,
        eps: float = 1e-6,
    ) -> None:
        """``modes`` maps a feature key (``"action"``) or a modality group (``"action.arm"``)
        to one of :data:`MODES`; group entries override the key-wide mode on their slice."""
        groups = _group_slices(modality)
        self.clip = clip
        self.offset: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor] = {}
        self.clip_mask: dict[str, torch.Tensor] = {}
        # Whole-key entries first, then group slices, so groups win where both apply.
        ordered = sorted(modes.items(), key=lambda kv: kv[0] in groups)
        for name, given in ordered:
            mode = ALIASES.get(given.lower(), given.lower())
            if mode not in MODES:
                raise ValueError(
                    f"normalization[{name!r}]={given!r}: use one of {MODES} "
                    f"(aliases: {sorted(ALIASES)}, case-insensitive)"
                )
            if name in groups:
                key, start, end = groups[name]
            elif name in stats:
                key, start, end = name, 0, None
            else:
                raise LeRobotFormatError(
                    f"normalization key {name!r} is neither a feature with stats "
                    f"({sorted(stats)}) nor a modality.json group ({sorted(groups)}); "
                    "fix the key or add stats/modality.json"
                )
            if key not in stats:
                raise LeRobotFormatError(
                    f"normalization[{name!r}]: no stats for feature {key!r} in stats.json"
                )
            st = stats[key]
            dim = int(np.asarray(st["mean"]).reshape(-1).shape[0])
            if key not in self.offset:
                self.offset[key] = torch.zeros(dim, dtype=torch.float64)
                self.scale[key] = torch.ones(dim, dtype=torch.float64)
                self.clip_mask[key] = torch.zeros(dim, dtype=torch.bool)
            sl = slice(start, dim if end is None else end)
            offset, scale = self._affine(st, mode, name, key)
            self.offset[key][sl] = offset[sl]
            self.scale[key][sl] = scale[sl].clamp_min(eps)
            self.clip_mask[key][sl] = mode in ("min_max", "q01_q99")

    @staticmethod
    def _affine(
        st: Mapping[str, np.ndarray], mode: str, name: str, key: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def get(stat: str) -> torch.Tensor:
            if stat not in st:
                raise LeRobotFormatError(
                    f"normalization[{name!r}]={mode!r} needs stats[{key!r}][{stat!r}], which "
                    f"stats.json lacks (has {sorted(st)}); pick another mode or recompute stats"
                )
            return torch.as_tensor(np.asarray(st[stat], dtype=np.float64).reshape(-1))

        dim = get("mean").shape[0]
        if mode == "identity":
            return torch.zeros(dim, dtype=torch.float64), torch.ones(dim, dtype=torch.float64)
        if mode == "mean_std":
            return get("mean"), get("std")
        lo, hi = (get("min"), get("max")) if mode == "min_max" else (get("q01"), get("q99"))
        return (lo + hi) / 2, (hi - lo) / 2

    def to_dict(self) -> dict[str, Any]:
        """JSON-able parameters (ship them with an exported policy to unnormalise actions)."""
        return {
            "clip": self.clip,
            "keys": {
                k: {
                    "offset": self.offset[k].tolist(),
                    "scale": self.scale[k].tolist(),
                    "clip_mask": self.clip_mask[k].tolist(),
                }
                for k in self.offset
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Normalizer:
        """Rebuild a normaliser from :meth:`to_dict` output (no stats needed)."""
        obj = cls.__new__(cls)
        obj.clip = bool(data["clip"])
        obj.offset, obj.scale, obj.clip_mask = {}, {}, {}
        for k, v in data["keys"].items():
            obj.offset[k] = torch.tensor(v["offset"], dtype=torch.float64)
            obj.scale[k] = torch.tensor(v["scale"], dtype=torch.float64)
            obj.clip_mask[k] = torch.tensor(v["clip_mask"], dtype=torch.bool)
        return obj

    @property
    def keys(self) -> list[str]:
        """Feature keys this normaliser touches."""
        return list(self.offset)

    def normalize(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` [..., D] of feature ``key`` (unknown keys pass through)."""
        if key not in self.offset:
            return x
        y = (x.double() - self.offset[key]) / self.scale[key]
        if self.clip:
            y = torch.where(self.clip_mask[key], y.clamp(-1.0, 1.0), y)
        return y.to(x.dtype if x.is_floating_point() else torch.float32)

    def unnormalize(self, key: str, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`normalize` (exact for values that were not clipped)."""
        if key not in self.offset:
            return y
        x = y.double() * self.scale[key] + self.offset[key]
        return x.to(y.dtype if y.is_floating_point() else torch.float32)

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """Normalise every known key of a sample dict."""
        return {k: self.normalize(k, v) if k in self.offset else v for k, v in sample.items()}

    def inverse(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """Unnormalise every known key of a sample dict (e.g. predicted actions)."""
        return {k: self.unnormalize(k, v) if k in self.offset else v for k, v in sample.items()}

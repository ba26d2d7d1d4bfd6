"""Feature statistics as LeRobot and GR00T store them (min/max/mean/std/count + quantiles)."""

from __future__ import annotations

from typing import Any

import numpy as np

from longboat.embodied.data.layout import QUANTILES


def feature_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Stats over axis 0 of a [N, ...] array, the same keys LeRobot writes (count has shape [1]).

    1-D inputs ([N] scalars) keep a trailing dim of 1, like LeRobot's ``keepdims`` for scalars.
    """
    arr = np.asarray(values)
    if arr.ndim == 1:
        arr = arr[:, None]
    as_float = arr.astype(np.float64)
    # Every stat is float64, integer columns included, as LeRobot (>= 0.5) stores them.
    out: dict[str, np.ndarray] = {
        "min": as_float.min(axis=0),
        "max": as_float.max(axis=0),
        "mean": as_float.mean(axis=0),
        "std": as_float.std(axis=0),
        "count": np.array([arr.shape[0]], dtype=np.int64),
    }
    for name, q in QUANTILES.items():
        out[name] = np.quantile(as_float, q, axis=0)
    return out


def image_stats(frames_nhwc: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel stats of uint8 frames [N,H,W,C], scaled to [0,1], shaped [C,1,1] as LeRobot."""
    chw = frames_nhwc.astype(np.float64).transpose(3, 0, 1, 2).reshape(frames_nhwc.shape[3], -1)
    chw = chw / 255.0
    out: dict[str, np.ndarray] = {
        "min": chw.min(axis=1)[:, None, None],
        "max": chw.max(axis=1)[:, None, None],
        "mean": chw.mean(axis=1)[:, None, None],
        "std": chw.std(axis=1)[:, None, None],
        "count": np.array([frames_nhwc.shape[0]], dtype=np.int64),
    }
    for name, q in QUANTILES.items():
        out[name] = np.quantile(chw, q, axis=1)[:, None, None]
    return out


def stats_to_json(stats: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, Any]]:
    """Numpy stats -> nested lists (what stats.json / episodes_stats.jsonl hold)."""
    return {key: {k: np.asarray(v).tolist() for k, v in st.items()} for key, st in stats.items()}


def stats_from_json(data: dict[str, dict[str, Any]]) -> dict[str, dict[str, np.ndarray]]:
    """Nested lists -> float64 numpy arrays (count stays int64)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, st in data.items():
        if not isinstance(st, dict):
            continue
        out[key] = {
            k: np.asarray(v, dtype=np.int64 if k == "count" else np.float64) for k, v in st.items()
        }
    return out

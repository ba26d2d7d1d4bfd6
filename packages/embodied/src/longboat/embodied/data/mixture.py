"""Several LeRobot datasets (one per embodiment) as one, and a collate that pads joint dims."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from longboat.embodied.data.dataset import EMBODIMENT_KEY, LeRobotDataset


class MultiLeRobotDataset(torch.utils.data.Dataset):
    """Concatenation of LeRobot datasets; dataset ``i`` gets embodiment id ``embodiment_ids[i]``.

    Extra keyword arguments go to every :class:`LeRobotDataset` (delta_timestamps,
    normalization, video_backend, ...). ``embodiment_ids`` defaults to 0, 1, 2, ... and
    overrides any ``embodiment_id`` column, so ids stay consistent across datasets.
    """

    def __init__(
        self,
        roots: Sequence[str | Path],
        *,
        embodiment_ids: Sequence[int] | None = None,
        **dataset_kwargs: Any,
    ) -> None:
        if not roots:
            raise ValueError("MultiLeRobotDataset needs at least one dataset root")
        ids = list(range(len(roots))) if embodiment_ids is None else list(embodiment_ids)
        if len(ids) != len(roots):
            raise ValueError(
                f"embodiment_ids has {len(ids)} entries for {len(roots)} roots; give one per root"
            )
        self.datasets = [
            LeRobotDataset(root, embodiment_id=eid, **dataset_kwargs)
            for root, eid in zip(roots, ids, strict=True)
        ]
        self._ends = list(_cumsum(len(d) for d in self.datasets))

    def __len__(self) -> int:
        return self._ends[-1]

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if not 0 <= idx < len(self):
            raise IndexError(f"index {idx} out of range for {len(self)} frames")
        i = bisect.bisect_right(self._ends, idx)
        start = self._ends[i - 1] if i else 0
        return self.datasets[i][idx - start]

    @property
    def episode_ranges(self) -> list[tuple[int, int]]:
        """[start, end) positions of every episode of every dataset (for samplers)."""
        out = []
        for i, d in enumerate(self.datasets):
            off = self._ends[i - 1] if i else 0
            out.extend((s + off, e + off) for s, e in d.episode_ranges)
        return out

    @property
    def skipped(self) -> int:
        """Samples skipped for decode errors in this process, over all datasets."""
        return sum(d.skipped for d in self.datasets)


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


def pad_collate(
    samples: Sequence[dict[str, Any]],
    *,
    max_state_dim: int,
    max_action_dim: int,
    state_key: str = "observation.state",
    action_key: str = "action",
) -> dict[str, Any]:
    """Batch samples of mixed embodiments: zero-pad state/action to the max dims.

    Adds ``state_dim_mask`` [B, max_state_dim] and ``action_dim_mask`` [B, max_action_dim]
    (True on real dims); strings become lists; everything else is stacked as by
    ``default_collate``.
    """
    out: dict[str, Any] = {}
    for key, max_dim, mask_key in (
        (state_key, max_state_dim, "state_dim_mask"),
        (action_key, max_action_dim, "action_dim_mask"),
    ):
        if key not in samples[0]:
            continue
        rows, masks = [], []
        for s in samples:
            x = s[key]
            d = x.shape[-1]
            if d > max_dim:
                raise ValueError(
                    f"{key} has {d} dims (embodiment {s.get(EMBODIMENT_KEY)}) but "
                    f"max dim is {max_dim}; raise max_{'state' if key == state_key else 'action'}_dim"
                )
            rows.append(torch.nn.functional.pad(x, (0, max_dim - d)))
            m = torch.zeros(max_dim, dtype=torch.bool)
            m[:d] = True
            masks.append(m)
        out[key] = torch.stack(rows)
        out[mask_key] = torch.stack(masks)
    for key in samples[0]:
        if key in out:
            continue
        vals = [s[key] for s in samples]
        out[key] = vals if isinstance(vals[0], str) else torch.utils.data.default_collate(vals)
    return out

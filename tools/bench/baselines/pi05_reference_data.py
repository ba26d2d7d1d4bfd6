"""Reference pi0.5 input pipeline: openpi's PyTorch data loader per sample, in DataLoader workers
(LeRobot dataset -> data transforms -> model transforms -> collate).

Per sample (``Pi05ReferenceDataset.__getitem__``): the episode's parquet row and action chunk
(``groot_n1_6_reference_data``'s trajectory cache and v2.1 reading, imported), every camera's
frame decoded alone with PyAV (LeRobot's ``pyav`` backend: open, seek to the keyframe before the
timestamp, decode forward to the frame), q01/q99 quantile normalisation of state and action to
[-1, 1], openpi's ``ResizeImages(224, 224)`` (PIL ``resize_with_pad``: bilinear resize of the
longer side, black padding) on uint8 HWC frames, missing cameras as zero images with a False mask
(as openpi's LIBERO/DROID inputs fill a missing wrist camera), ``TokenizePrompt`` with the
discretised state (``pi05_reference.tokenize_prompt``) and ``PadStatesAndActions`` to
``action_dim``. ``collate`` stacks (every entry has a fixed shape).

Differences from openpi's loader besides ``pi05_reference.py``'s: LeRobot v2.1 only; no repack /
robot-specific input transform (the synthetic dataset has openpi's key layout: one state, one
action vector, RGB cameras); ``action_is_pad`` is ignored, as openpi does (LeRobot clamps the
chunk at the episode end); frames are decoded straight to uint8 HWC, where LeRobot returns float32
CHW in [0, 1] and openpi converts each back (two per-frame copies the reference is spared); the
episode's parquet is read once per trajectory instead of LeRobot's arrow-backed rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import groot_n1_6_reference_data as groot_data
from . import pi05_reference as ref
from .groot_n1_6_reference_data import ACTION_KEY, STATE_KEY, ReferenceLeRobotDataset


def resize_with_pad(frame: np.ndarray, size: int) -> np.ndarray:
    """openpi's ``image_tools.resize_with_pad``: PIL bilinear, aspect kept, centred, zero pad."""
    from PIL import Image

    h, w = frame.shape[:2]
    if (h, w) == (size, size):
        return frame
    ratio = max(w / size, h / size)
    rh, rw = int(h / ratio), int(w / ratio)
    img = Image.fromarray(frame).resize((rw, rh), resample=Image.BILINEAR)
    out = np.zeros((size, size, 3), np.uint8)
    top, left = (size - rh) // 2, (size - rw) // 2
    out[top : top + rh, left : left + rw] = np.asarray(img)
    return out


def decode_frame(path: Path, timestamp: float, tolerance: float = 1e-4) -> np.ndarray:
    """LeRobot's PyAV path: seek to the keyframe before ``timestamp``, decode up to its frame."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        tb = float(stream.time_base)
        container.seek(int(max(0.0, timestamp) / tb), stream=stream, backward=True)
        last = None
        for frame in container.decode(stream):
            last = frame
            if frame.pts is not None and frame.pts * tb >= timestamp - tolerance:
                break
        if last is None:
            raise ValueError(f"{path}: no frame at {timestamp:.4f}s")
        return last.to_ndarray(format="rgb24")


class Pi05ReferenceDataset(ReferenceLeRobotDataset):
    """Map-style dataset over LeRobot v2.1 roots yielding openpi's per-sample pi0.5 inputs."""

    def __init__(self, roots: list[Path], shapes: Any) -> None:
        super().__init__(roots, shapes, max_text_tokens=shapes.max_text_tokens)
        self.quantiles = []
        for part in self.parts:
            stats = json.loads((part.root / "meta/stats.json").read_text())
            q = {}
            for key in (STATE_KEY, ACTION_KEY):
                st = stats[key]
                lo, hi = st.get("q01", st["min"]), st.get("q99", st["max"])
                q[key] = (np.asarray(lo, np.float32), np.asarray(hi, np.float32))
            self.quantiles.append(q)

    def _normalize(self, x: np.ndarray, pi: int, key: str) -> np.ndarray:
        lo, hi = self.quantiles[pi][key]
        return (x - lo) / (hi - lo + 1e-6) * 2.0 - 1.0  # openpi's Normalize(use_quantiles)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        pi, ep, frame, length = self.index[idx]
        part, s = self.parts[pi], self.s
        traj = self._trajectory(pi, ep)
        state = self._normalize(traj[STATE_KEY][frame], pi, STATE_KEY)
        rows = np.minimum(np.arange(frame, frame + s.horizon), length - 1)
        action = self._normalize(traj[ACTION_KEY][rows], pi, ACTION_KEY)
        fps = float(part.info.get("fps", 30))
        images, present = [], []
        for key in part.video_keys[: s.num_cameras]:
            img = decode_frame(part.video_path(ep, key), frame / fps)
            images.append(resize_with_pad(img, s.image_size))
            present.append(True)
        while len(images) < s.num_cameras:
            images.append(np.zeros((s.image_size, s.image_size, 3), np.uint8))
            present.append(False)
        task = part.episodes[ep]["tasks"][0] if part.episodes[ep].get("tasks") else ""
        text = [1 + b % (s.vocab - 1) for b in task.encode("utf-8")]  # longboat's stand-in
        tokens, token_mask = ref.tokenize_prompt(text, state, s)
        state_p = np.zeros(s.max_state_dim, np.float32)
        state_p[: state.shape[0]] = state
        action_p = np.zeros((s.horizon, s.action_dim), np.float32)
        action_p[:, : action.shape[1]] = action
        return {
            "images": torch.from_numpy(np.stack(images)),  # [C, H, W, 3] uint8
            "image_mask": torch.tensor(present),
            "tokenized_prompt": torch.from_numpy(tokens),
            "tokenized_prompt_mask": torch.from_numpy(token_mask),
            "state": torch.from_numpy(state_p),
            "action": torch.from_numpy(action_p),
        }


def collate(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """openpi's collate: stack every entry."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def build_loader(
    dataset: Pi05ReferenceDataset, batch_size: int, num_workers: int, seed: int = 0
) -> torch.utils.data.DataLoader:
    """openpi's ``TorchDataLoader``: shuffled, workers, drop_last (pinned like the others)."""
    return groot_data.build_loader(dataset, batch_size, num_workers, seed, collate_fn=collate)

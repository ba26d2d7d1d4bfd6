"""Reference GR00T-N1.6 input pipeline: the official loader's per-sample work, in DataLoader
workers.

Per sample (``ReferenceLeRobotDataset.__getitem__``): the episode's parquet (only the current
trajectory cached, as GR00T's ``LeRobotSingleDataset``), min-max normalised state and action
(``meta/stats.json``), the *whole* episode video of every camera decoded with PyAV to keep one
frame (the official video path's known waste), then per frame the PIL augmentation (resize
shortest side, random crop of ``crop_fraction``, resize back, resize to multiples of
``multiple_of``) and the processor (to float, mean/std 0.5, Siglip2 patches ``[patches, p*p*3]``),
and the prompt: image placeholders, then the task string. ``collate`` pads and stacks.

Differences from the official loader (see also ``groot_n1_6_reference.py``): LeRobot v2.1 only
(what GR00T reads); no chat template / Qwen tokenizer (longboat's byte-level stand-in, so both
loops see the same tokens); PyAV decoding (GR00T's ``torchvision_av`` also goes through PyAV).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

STATE_KEY = "observation.state"
ACTION_KEY = "action"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _OneDataset:
    """One LeRobot v2.1 dataset root: episode table, stats, file templates."""

    def __init__(self, root: Path, embodiment_id: int) -> None:
        self.root = root
        self.info = json.loads((root / "meta/info.json").read_text())
        if not str(self.info.get("codebase_version", "")).startswith("v2"):
            raise ValueError(
                f"{root}/meta/info.json: codebase_version={self.info.get('codebase_version')!r}; "
                "the reference loader reads LeRobot v2.x (write the dataset with layout='v2.1')"
            )
        self.video_keys = [k for k, f in self.info["features"].items() if f["dtype"] == "video"]
        self.episodes = _read_jsonl(root / "meta/episodes.jsonl")
        stats = json.loads((root / "meta/stats.json").read_text())
        self.stats = {
            k: (np.asarray(stats[k]["min"], np.float32), np.asarray(stats[k]["max"], np.float32))
            for k in (STATE_KEY, ACTION_KEY)
        }
        self.embodiment_id = embodiment_id
        self.chunks_size = int(self.info.get("chunks_size", 1000))

    def data_path(self, ep: int) -> Path:
        chunk = ep // self.chunks_size
        return self.root / self.info["data_path"].format(episode_chunk=chunk, episode_index=ep)

    def video_path(self, ep: int, key: str) -> Path:
        chunk = ep // self.chunks_size
        return self.root / self.info["video_path"].format(
            episode_chunk=chunk, video_key=key, episode_index=ep
        )


class ReferenceLeRobotDataset(torch.utils.data.Dataset):
    """Map-style dataset over one or more LeRobot v2.1 roots (one per embodiment)."""

    def __init__(self, roots: list[Path], shapes: Any, *, max_text_tokens: int = 32) -> None:
        self.s = shapes
        self.parts = [_OneDataset(Path(r), i) for i, r in enumerate(roots)]
        self.index: list[tuple[int, int, int, int]] = []  # (part, episode, frame, length)
        for pi, part in enumerate(self.parts):
            for ep in part.episodes:
                n = int(ep["length"])
                self.index += [(pi, int(ep["episode_index"]), f, n) for f in range(n)]
        self.max_text_tokens = max_text_tokens
        self._traj: tuple[int, int] | None = None
        self._traj_data: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.index)

    # ---------------------------------------------------------------- per-sample work

    def _trajectory(self, pi: int, ep: int) -> dict[str, np.ndarray]:
        if self._traj != (pi, ep):
            import pyarrow.parquet as pq

            table = pq.read_table(self.parts[pi].data_path(ep))
            self._traj_data = {
                k: np.stack(table.column(k).to_numpy(zero_copy_only=False)).astype(np.float32)
                for k in (STATE_KEY, ACTION_KEY)
            }
            self._traj = (pi, ep)
        return self._traj_data

    def _decode_whole_episode(self, path: Path) -> list[np.ndarray]:
        import av

        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            return [f.to_ndarray(format="rgb24") for f in container.decode(stream)]

    def _augment(self, frame: np.ndarray) -> Tensor:
        """PIL resize -> random crop -> resize back -> to patch multiples -> processor."""
        from PIL import Image

        s = self.s
        img = Image.fromarray(frame)
        w, h = img.size
        if s.resize_shortest:
            scale = s.resize_shortest / min(w, h)
            w, h = max(1, round(w * scale)), max(1, round(h * scale))
            img = img.resize((w, h), Image.BILINEAR)
        if s.crop_fraction < 1.0:
            cw, ch = int(w * s.crop_fraction), int(h * s.crop_fraction)
            left, top = random.randint(0, w - cw), random.randint(0, h - ch)
            img = img.crop((left, top, left + cw, top + ch)).resize((w, h), Image.BILINEAR)
        m = s.multiple_of
        ow, oh = w // m * m, h // m * m
        if (ow, oh) != (w, h):
            img = img.resize((ow, oh), Image.BILINEAR)
        # Siglip2 processor: rescale 1/255, normalise (0.5, 0.5), patchify.
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        x = (x - 0.5) / 0.5
        p = s.patch
        gh, gw = oh // p, ow // p
        patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 2, 4, 0).reshape(gh * gw, p * p * 3)
        return patches, (gh, gw)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        pi, ep, frame, length = self.index[idx]
        part = self.parts[pi]
        s = self.s
        traj = self._trajectory(pi, ep)
        lo_s, hi_s = part.stats[STATE_KEY]
        lo_a, hi_a = part.stats[ACTION_KEY]
        state = (traj[STATE_KEY][frame] - lo_s) / np.maximum(hi_s - lo_s, 1e-8) * 2 - 1
        rows = np.arange(frame, frame + s.horizon)
        is_pad = rows >= length
        action = traj[ACTION_KEY][np.minimum(rows, length - 1)]
        action = (action - lo_a) / np.maximum(hi_a - lo_a, 1e-8) * 2 - 1
        pixel_values, grids = [], []
        for key in part.video_keys:
            frames = self._decode_whole_episode(part.video_path(ep, key))
            patches, grid = self._augment(frames[min(frame, len(frames) - 1)])
            pixel_values.append(patches)
            grids.append(grid)
        tokens_per_image = (grids[0][0] // 2) * (grids[0][1] // 2)
        task = part.episodes[ep]["tasks"][0] if part.episodes[ep].get("tasks") else ""
        limit = min(s.vocab, s.image_token_id)
        text = [1 + b % (limit - 1) for b in task.encode("utf-8")][: self.max_text_tokens]
        ids = [s.image_token_id] * (tokens_per_image * len(pixel_values)) + text
        state_p = np.zeros(s.max_state_dim, np.float32)
        state_p[: state.shape[0]] = state
        action_p = np.zeros((s.horizon, s.max_action_dim), np.float32)
        action_p[:, : action.shape[1]] = action
        action_mask = np.zeros_like(action_p)
        action_mask[~is_pad, : action.shape[1]] = 1.0
        return {
            "pixel_values": torch.stack(pixel_values),
            "spatial_shapes": torch.tensor(grids, dtype=torch.int64),
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "state": torch.from_numpy(state_p),
            "action": torch.from_numpy(action_p),
            "action_mask": torch.from_numpy(action_mask),
            "embodiment_id": torch.tensor(part.embodiment_id, dtype=torch.int64),
        }


STACKED = ("state", "action", "action_mask", "embodiment_id")


def collate(samples: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Stack cameras into the ViT batch, right-pad the prompts."""
    length = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.zeros(len(samples), length, dtype=torch.int64)
    attention = torch.zeros(len(samples), length, dtype=torch.int64)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        input_ids[row, :n] = s["input_ids"]
        attention[row, :n] = 1
    pixel_values = torch.cat([s["pixel_values"] for s in samples])
    return {
        "pixel_values": pixel_values,
        "pixel_attention_mask": torch.ones(pixel_values.shape[:2], dtype=torch.int64),
        "spatial_shapes": torch.cat([s["spatial_shapes"] for s in samples]),
        "input_ids": input_ids,
        "attention_mask": attention,
        **{k: torch.stack([s[k] for s in samples]) for k in STACKED},
    }


def build_loader(
    dataset: torch.utils.data.Dataset,
    batch_size: int,
    num_workers: int,
    seed: int = 0,
    collate_fn: Any = collate,
) -> torch.utils.data.DataLoader:
    """HF Trainer's loader (shuffled, pinned, workers, drop_last); openpi's differs by collate."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=g,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=torch.accelerator.is_available(),
        drop_last=True,
        persistent_workers=num_workers > 0,
        prefetch_factor=2 if num_workers > 0 else None,
    )

"""Helpers the vlm tests share: synthetic video files and packed Qwen2.5-VL-style rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch


def random_frames(n: int, h: int, w: int, seed: int) -> list[np.ndarray]:
    """``n`` random ``h x w`` RGB frames (uint8) from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def write_mp4(path: Path, frames: list[np.ndarray], fps: int) -> None:
    """Encode ``frames`` with PyAV (skips the test when no encoder is available)."""
    av = pytest.importorskip("av")
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())


def packed_image_row(cfg: Any, seed: int, grids: list[list[int]], text: int = 6) -> dict[str, Any]:
    """One packed microbatch of a Qwen2.5-VL-style ``cfg``: per grid, ``text`` random tokens,
    one image in its vision start / end tokens and ``text`` more, with next-token labels and
    a loss mask without image positions or targets across a sample boundary."""
    v = cfg.vision
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    bounds = [0]
    for grid in grids:
        n = grid[0] * grid[1] * grid[2] // v.spatial_merge_size**2
        sample = torch.randint(0, 300, (text,), generator=g).tolist()
        sample += [cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id]
        sample += torch.randint(0, 300, (text,), generator=g).tolist()
        ids += sample
        bounds.append(len(ids))
    input_ids = torch.tensor([ids])
    labels = torch.roll(input_ids, -1, dims=1)
    loss_mask = (input_ids != cfg.image_token_id).float()
    for b in bounds[1:]:
        loss_mask[0, b - 1] = 0.0  # no target across a sample boundary
    gt = torch.tensor(grids)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "cu_seqlens": bounds,
        "pixel_values": torch.randn(int(gt.prod(-1).sum()), v.patch_dim, generator=g),
        "image_grid_thw": gt,
    }

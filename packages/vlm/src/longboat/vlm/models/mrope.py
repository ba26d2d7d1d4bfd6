"""M-RoPE position ids (Qwen2-VL / Qwen2.5-VL / Qwen3-VL): three position streams per token.

Text tokens advance all three streams together by one. The tokens of an image or a video
take ``(t, h, w)`` positions on its merged patch grid, offset by the position where the
vision run starts; the temporal stream of a video steps by ``tokens_per_second *
seconds_per_grid`` per frame group. The text after a vision run continues from the run's
start plus its longest spatial side (``max(h, w)`` merged patches).

Qwen3-VL writes a video as one run per frame group, each behind its timestamp text
(``frames_as_runs``): every frame group is then placed like a one-frame image. Its rotary
also interleaves the streams over the frequencies instead of giving each a contiguous block
(``interleaved_mrope_sections`` expresses that layout in megatron's block terms).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


def token_types(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """``0`` for text, ``1`` for image and ``2`` for video placeholder tokens (same shape)."""
    types = torch.zeros_like(input_ids, dtype=torch.int8)
    types[input_ids == image_token_id] = IMAGE
    types[input_ids == video_token_id] = VIDEO
    return types


def _runs(types: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(type, start, end)`` of each maximal run of equal token types."""
    start = 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            yield types[start], start, i
            start = i


def _grid_positions(
    start: int, grid_thw: Sequence[int], merge: int, time_step: float
) -> torch.Tensor:
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    tt = (torch.arange(t) * time_step).long() + start
    hh = torch.arange(h) + start
    ww = torch.arange(w) + start
    grid = torch.stack(torch.meshgrid(tt, hh, ww, indexing="ij"), dim=0)
    return grid.reshape(3, -1)


def sample_position_ids(
    types: Sequence[int],
    image_grids: Iterator[Sequence[int]],
    video_grids: Iterator[Sequence[int]],
    video_seconds: Iterator[float],
    *,
    spatial_merge_size: int,
    tokens_per_second: float,
    frames_as_runs: bool = False,
) -> torch.Tensor:
    """``[3, len(types)]`` position ids of one sample; consumes one grid per vision run
    (``frames_as_runs``: a video run takes as many one-frame grids as fill it)."""
    parts: list[torch.Tensor] = []
    pos = 0
    for kind, start, end in _runs(list(types)):
        if kind == TEXT:
            parts.append(torch.arange(pos, pos + end - start).expand(3, -1))
            pos += end - start
            continue
        if kind == VIDEO and frames_as_runs:
            pos = _frame_runs(parts, pos, start, end, video_grids, spatial_merge_size)
            continue
        grid = next(image_grids if kind == IMAGE else video_grids)
        step = tokens_per_second * next(video_seconds) if kind == VIDEO else 1.0
        ids = _grid_positions(pos, grid, spatial_merge_size, step)
        if ids.shape[1] != end - start:
            raise ValueError(
                f"a run of {end - start} {'image' if kind == IMAGE else 'video'} tokens at "
                f"{start} does not match its grid {list(map(int, grid))} "
                f"({ids.shape[1]} merged patches)"
            )
        parts.append(ids)
        pos += max(int(grid[1]), int(grid[2])) // spatial_merge_size
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(parts, dim=1)


def _frame_runs(
    parts: list[torch.Tensor],
    pos: int,
    start: int,
    end: int,
    frames: Iterator[Sequence[int]],
    merge: int,
) -> int:
    """Positions of a video run of one-frame grids laid end to end; returns the next position."""
    covered = 0
    while covered < end - start:
        grid = next(frames, None)
        if grid is None:
            raise ValueError(f"a run of {end - start} video tokens at {start} has no frame left")
        ids = _grid_positions(pos, grid, merge, 1.0)
        parts.append(ids)
        covered += ids.shape[1]
        pos += max(int(grid[1]), int(grid[2])) // merge
    if covered != end - start:
        raise ValueError(
            f"a run of {end - start} video tokens at {start} does not end on a frame boundary "
            f"({covered} tokens of whole frames)"
        )
    return pos


def mrope_position_ids(
    input_ids: torch.Tensor,
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    tokens_per_second: float,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    seconds_per_grid: Sequence[float] | None = None,
    cu_seqlens: Sequence[int] | None = None,
    frames_as_runs: bool = False,
) -> torch.Tensor:
    """``[3, batch, seq]`` position ids for ``input_ids`` ``[batch, seq]``.

    Images and videos are consumed in order across the batch (row by row). With
    ``cu_seqlens`` (one packed row, ``batch == 1``) each packed sample starts again at 0.
    ``seconds_per_grid``: one value per video (default 1.0). ``frames_as_runs`` (Qwen3-VL):
    each frame group of a video is its own run of video tokens, placed like a one-frame image
    (the timestamps between the runs are text).
    """
    types = token_types(input_ids, image_token_id, video_token_id).tolist()
    images = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
    video_list = video_grid_thw.tolist() if video_grid_thw is not None else []
    if frames_as_runs:
        video_list = [[1, h, w] for t, h, w in video_list for _ in range(int(t))]
    videos = iter(video_list)
    n_videos = 0 if video_grid_thw is None else int(video_grid_thw.shape[0])
    seconds = iter(list(seconds_per_grid) if seconds_per_grid is not None else [1.0] * n_videos)
    kw = dict(
        spatial_merge_size=spatial_merge_size,
        tokens_per_second=tokens_per_second,
        frames_as_runs=frames_as_runs,
    )
    rows = []
    for row in types:
        bounds = [int(x) for x in cu_seqlens] if cu_seqlens is not None else [0, len(row)]
        if cu_seqlens is not None and (input_ids.shape[0] != 1 or bounds[-1] != len(row)):
            raise ValueError("cu_seqlens needs one packed row whose length is cu_seqlens[-1]")
        rows.append(
            torch.cat(
                [
                    sample_position_ids(row[a:b], images, videos, seconds, **kw)
                    for a, b in itertools.pairwise(bounds)
                ],
                dim=1,
            )
        )
    return torch.stack(rows, dim=1).to(input_ids.device)


def interleaved_mrope_streams(section: Sequence[int], head_dim: int) -> list[int]:
    """The position stream (0 temporal, 1 height, 2 width) of each of the ``head_dim / 2``
    rotary frequencies in Qwen3-VL's interleaved layout: frequency ``j`` follows the height
    when ``j % 3 == 1`` and ``j < 3 * section[1]``, the width when ``j % 3 == 2`` and
    ``j < 3 * section[2]``, the time otherwise."""
    out = []
    for j in range(head_dim // 2):
        if j % 3 == 1 and j < 3 * section[1]:
            out.append(1)
        elif j % 3 == 2 and j < 3 * section[2]:
            out.append(2)
        else:
            out.append(0)
    return out


def interleaved_mrope_sections(section: Sequence[int], head_dim: int) -> list[int]:
    """megatron ``mrope_section`` giving Qwen3-VL's interleaved layout.

    megatron's ``MultimodalRotaryEmbedding`` splits the frequencies into consecutive chunks
    of the listed sizes, chunk ``i`` following stream ``i % 3``, and applies the same list
    to the second half of the head. The interleaved streams become their run lengths, with
    empty chunks where a stream is skipped, padded to a multiple of three chunks so that the
    second half lines up with the first.
    """
    chunks: list[int] = []
    for stream in interleaved_mrope_streams(section, head_dim):
        if chunks and (len(chunks) - 1) % 3 == stream:
            chunks[-1] += 1
            continue
        while len(chunks) % 3 != stream:
            chunks.append(0)
        chunks.append(1)
    chunks += [0] * (-len(chunks) % 3)
    return chunks

"""The quickstart's data: the generated shapes set and its tokenizer, written once."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def prepare_shapes(data: Any, *, seed: int) -> tuple[list[Path], list[Path], Path]:
    """``(train files, held-out files, tokenizer dir)`` of ``data`` (a ``ShapesDataConfig``)
    under ``data.out_dir``; files already there with the same settings are reused. With
    several ranks rank 0 writes them first (ranks writing one directory at once would read
    each other's half-written files) and the others reuse them."""
    import torch.distributed as dist

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not several:
        return _prepare(data, seed)
    error = None
    if dist.get_rank() == 0:
        try:
            _prepare(data, seed)
        except Exception as exc:  # the others wait at the barrier below, then see it too
            error = exc
    dist.barrier()
    if error is not None:
        raise error
    return _prepare(data, seed)


def _prepare(data: Any, seed: int) -> tuple[list[Path], list[Path], Path]:
    from longboat.vlm.data.shapes import build_shapes_tokenizer, make_shapes_dataset

    out = Path(data.out_dir)
    n = data.num_train + data.num_eval
    made = make_shapes_dataset(
        out / "shapes", n, seed, size=data.image_size, held_out_fraction=data.num_eval / n
    )
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        build_shapes_tokenizer(tok_dir)
    return [made.train], [made.held_out], tok_dir

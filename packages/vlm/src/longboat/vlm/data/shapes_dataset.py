"""The quickstart's dataset: coloured shapes at positions, with questions a tiny VLM learns.

Each image (white background, PNG) holds one shape — circle, square or triangle — in one of
five colours, centred left, right, top or bottom (with a little jitter of place and size).
Each record is LLaVA-style JSON lines: the image path (relative to the dataset folder) and
one or two question/answer turns (or ``questions`` of them) about the colour, the shape, the
position, or all three (``"Describe the image."`` -> ``"a red circle on the left"``); the
first question starts with ``<image>\\n``. The same seed gives the same files byte for byte.

:func:`prepare_shapes_dataset` writes a run's set (``data=shapes``) and its tokenizer once,
rank 0 first when several processes train.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from longboat.vlm.data.tiny_tokenizer import VLMTokenizerInfo, build_vlm_tokenizer

__all__ = [
    "COLOURS",
    "POSITIONS",
    "QUESTIONS",
    "SHAPES",
    "ShapesDataset",
    "answer",
    "build_shapes_tokenizer",
    "draw_shape",
    "make_shapes_dataset",
    "prepare_shapes_dataset",
    "shapes_texts",
]

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 180),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {"left": (0.25, 0.5), "right": (0.75, 0.5), "top": (0.5, 0.25), "bottom": (0.5, 0.75)}
_WHERE = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
}
QUESTIONS = {
    "colour": "What colour is the shape?",
    "shape": "What shape is it?",
    "position": "Where is the shape?",
    "describe": "Describe the image.",
}
META = "shapes.json"


@dataclass(frozen=True)
class ShapesDataset:
    """The files :func:`make_shapes_dataset` wrote."""

    root: Path
    """The folder; image paths in the records are relative to it."""
    train: Path
    """``train.jsonl``."""
    held_out: Path
    """``held_out.jsonl`` (other images, same distribution)."""
    num_train: int
    num_held_out: int


def answer(kind: str, colour: str, shape: str, position: str) -> str:
    """The answer to question ``kind`` about a ``colour`` ``shape`` at ``position``."""
    return {
        "colour": colour,
        "shape": shape,
        "position": position,
        "describe": f"a {colour} {shape} {_WHERE[position]}",
    }[kind]


def draw_shape(
    size: int, colour: str, shape: str, position: str, rng: np.random.Generator
) -> Image.Image:
    """A ``size`` x ``size`` RGB image of one shape."""
    img = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    fx, fy = POSITIONS[position]
    jitter = size * 0.04
    cx = fx * size + rng.uniform(-jitter, jitter)
    cy = fy * size + rng.uniform(-jitter, jitter)
    r = size * rng.uniform(0.14, 0.2)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img


def _record(
    i: int,
    image: str,
    colour: str,
    shape: str,
    position: str,
    rng: np.random.Generator,
    questions: int | None = None,
) -> dict:
    kinds = list(QUESTIONS)
    n_turns = int(rng.integers(1, 3)) if questions is None else questions
    asked = [kinds[k] for k in rng.choice(len(kinds), size=n_turns, replace=False)]
    turns = []
    for j, kind in enumerate(asked):
        question = ("<image>\n" if j == 0 else "") + QUESTIONS[kind]
        turns.append({"from": "human", "value": question})
        turns.append({"from": "gpt", "value": answer(kind, colour, shape, position)})
    return {
        "id": f"shapes-{i:05d}",
        "image": image,
        "conversations": turns,
        "meta": {"colour": colour, "shape": shape, "position": position},
    }


def make_shapes_dataset(
    out_dir: str | Path,
    n: int,
    seed: int = 0,
    *,
    size: int = 56,
    held_out_fraction: float = 0.1,
    questions: int | None = None,
) -> ShapesDataset:
    """Write ``n`` samples (``held_out_fraction`` of them held out, at least one) to ``out_dir``.

    ``questions``: turns per record, distinct kinds in a random order (None: one or two;
    4: every kind, so each image carries four answers' worth of learning signal).

    ``out_dir`` gets ``images/*.png``, ``train.jsonl``, ``held_out.jsonl`` and ``shapes.json``
    (the arguments); a second call with the same arguments reuses the files.
    """
    if n < 2:
        raise ValueError(f"n={n}: need at least 2 samples (one is held out)")
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction={held_out_fraction} must be in (0, 1)")
    if questions is not None and not 1 <= questions <= len(QUESTIONS):
        raise ValueError(f"questions={questions} must be null or 1..{len(QUESTIONS)}")
    out = Path(out_dir)
    n_held = min(n - 1, max(1, round(n * held_out_fraction)))
    wanted = {"n": n, "seed": seed, "size": size, "held_out": n_held, "version": 1}
    if questions is not None:
        wanted["questions"] = questions
    result = ShapesDataset(out, out / "train.jsonl", out / "held_out.jsonl", n - n_held, n_held)
    meta = out / META
    if meta.is_file() and json.loads(meta.read_text()) == wanted and result.held_out.is_file():
        return result
    (out / "images").mkdir(parents=True, exist_ok=True)
    meta.unlink(missing_ok=True)
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        position = list(POSITIONS)[int(rng.integers(len(POSITIONS)))]
        name = f"images/{i:05d}.png"
        draw_shape(size, colour, shape, position, rng).save(out / name)
        records.append(_record(i, name, colour, shape, position, rng, questions))
    for path, part in ((result.train, records[n_held:]), (result.held_out, records[:n_held])):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
        tmp.replace(path)
    meta.write_text(json.dumps(wanted))
    return result


def shapes_texts() -> list[str]:
    """Every question and answer the dataset can hold, as turns (tokenizer training text)."""
    texts = [f"user\n{q}" for q in QUESTIONS.values()]
    for colour in COLOURS:
        for shape in SHAPES:
            for position in POSITIONS:
                texts += [f"assistant\n{answer(k, colour, shape, position)}" for k in QUESTIONS]
    return [*texts, "system\nYou are a helpful assistant."]


def build_shapes_tokenizer(out_dir: str | Path, *, vocab_size: int = 384) -> VLMTokenizerInfo:
    """The quickstart tokenizer (:func:`~longboat.vlm.data.tiny_tokenizer.build_vlm_tokenizer`
    trained on :func:`shapes_texts`) and the ids a model config needs."""
    return build_vlm_tokenizer(shapes_texts(), out_dir, vocab_size=vocab_size)


def prepare_shapes_dataset(data: Any, *, seed: int) -> tuple[list[Path], list[Path], Path]:
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
    out = Path(data.out_dir)
    n = data.num_train + data.num_eval
    made = make_shapes_dataset(
        out / "shapes",
        n,
        seed,
        size=data.image_size,
        held_out_fraction=data.num_eval / n,
        questions=getattr(data, "questions_per_image", None),
    )
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        build_shapes_tokenizer(tok_dir)
    return [made.train], [made.held_out], tok_dir

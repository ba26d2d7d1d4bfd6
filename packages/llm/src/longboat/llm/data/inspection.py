"""``data inspect``: counts, a length histogram and decoded samples of a prepared dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from longboat.llm.data.indexed import IndexedTokenDataset

__all__ = ["inspect_dataset", "length_histogram"]


def length_histogram(lengths: np.ndarray, *, bins: int = 10, width: int = 40) -> list[str]:
    """Text histogram lines ``[lo, hi) count bar`` of document lengths."""
    if len(lengths) == 0:
        return ["(no documents)"]
    lo, hi = int(lengths.min()), int(lengths.max())
    edges = np.linspace(lo, hi + 1, num=min(bins, hi + 1 - lo) + 1).round().astype(np.int64)
    counts, _ = np.histogram(lengths, bins=edges)
    peak = max(int(counts.max()), 1)
    pad = len(str(int(edges[-1])))
    lines = []
    for a, b, c in zip(edges[:-1], edges[1:], counts, strict=True):
        bar = "#" * max(round(width * int(c) / peak), 1 if c else 0)
        lines.append(f"[{a:>{pad}}, {b:>{pad}}) {int(c):>8}  {bar}")
    return lines


def inspect_dataset(
    path: str | Path, *, tokenizer: str | Path | None = None, samples: int = 3, max_chars: int = 300
) -> str:
    """The ``data inspect`` report of dataset ``path`` as text."""
    ds = IndexedTokenDataset(path)
    m = ds.manifest
    lengths = ds.lengths()
    out = [
        f"dataset      {Path(path)}",
        f"kind         {m['kind']}   dtype {m['dtype']}   vocab {m['vocab_size']}",
        f"documents    {len(ds):,}",
        f"tokens       {ds.num_tokens:,}",
        f"doc length   min {lengths.min()}  mean {lengths.mean():.1f}  "
        f"median {int(np.median(lengths))}  max {lengths.max()}",
    ]
    if ds.has_loss_mask:
        trained = ds.num_loss_tokens
        out.append(f"loss tokens  {trained:,} ({100 * trained / max(ds.num_tokens, 1):.1f}%)")
    if m.get("report"):
        out.append("report       " + ", ".join(f"{k}={v}" for k, v in m["report"].items()))
    out += ["", "length histogram (tokens per document):", *length_histogram(lengths)]
    tok = _tokenizer(tokenizer or m.get("tokenizer_path"), out)
    if tok is not None:
        for i in np.linspace(0, len(ds) - 1, num=min(samples, len(ds))).astype(int):
            text = tok.decode(np.asarray(ds[int(i)]).tolist())
            text = text if len(text) <= max_chars else text[:max_chars] + " ..."
            out += ["", f"--- document {i} ({len(ds[int(i)])} tokens) ---", text]
    return "\n".join(out)


def _tokenizer(path: Any, out: list[str]) -> Any:
    if path is None or not Path(path).is_dir():
        out += ["", f"(no samples: tokenizer dir {path} not found; pass --tokenizer)"]
        return None
    from longboat.llm.data.encoding import load_tokenizer

    return load_tokenizer(path)

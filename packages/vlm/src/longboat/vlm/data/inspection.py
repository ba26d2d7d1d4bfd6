"""A readable summary of packed multimodal data (what ``data inspect`` prints)."""

from __future__ import annotations

from typing import Any

import numpy as np

from longboat.vlm.data.encoding import EncodingReport
from longboat.vlm.data.packing import PackedMultimodalDataset

__all__ = ["describe_row", "inspect_packed"]


def describe_row(row: dict[str, Any], tokenizer: Any) -> str:
    """The row's text with each vision run shown as ``<|image_pad|>x<N>`` and the training
    targets (tokens some label predicts) inside ``[[ ]]``; padding is left out."""
    ids = row["input_ids"][0].tolist()
    labels = row["labels"][0].tolist()
    end = int(row["cu_seqlens"][len(row["sample_index"])])
    target = [False] + [lab >= 0 for lab in labels[:-1]]  # labels[i] predicts token i + 1
    pieces: list[str] = []
    i = 0
    while i < end:
        j = i + 1
        while j < end and ids[j] == ids[i] and target[j] == target[i]:
            j += 1
        text = tokenizer.decode(ids[i:j])
        token = tokenizer.convert_ids_to_tokens(ids[i])
        if j - i > 1 and token in ("<|image_pad|>", "<|video_pad|>"):
            text = f"{token}x{j - i}"
        pieces.append(f"[[{text}]]" if target[i] else text)
        i = j
    return "".join(pieces).replace("]][[", "")


def inspect_packed(
    dataset: PackedMultimodalDataset,
    tokenizer: Any,
    *,
    report: EncodingReport | None = None,
    rows: int = 2,
) -> str:
    """Counts (records, kept and skipped samples, rows, fill, tokens, images, videos) and the
    first ``rows`` rows decoded with :func:`describe_row`."""
    s = dataset.samples
    lengths = np.asarray([len(x) for x in s])
    targets = int(sum(int(x.loss_mask.sum()) for x in s))
    lines = []
    if report is not None:
        lines.append("encoding: " + ", ".join(f"{k}={v}" for k, v in report.as_dict().items()))
        lines += [f"  skipped: {b}" for b in report.bad]
    lines += [
        f"samples: {len(s):,}  tokens: {int(lengths.sum()):,}  target tokens: {targets:,}",
        f"sample length: min {lengths.min()}  mean {lengths.mean():.1f}  max {lengths.max()}",
        f"images: {sum(len(x.images) for x in s):,}  videos: {sum(len(x.videos) for x in s):,}",
        f"rows: {len(dataset):,} of {dataset.seq_len} tokens  fill: {dataset.fill:.1%}",
    ]
    for r in range(min(rows, len(dataset))):
        row = dataset[r]
        lines.append(f"--- row {r}: samples {row['sample_index']}")
        lines.append(describe_row(row, tokenizer))
    return "\n".join(lines)

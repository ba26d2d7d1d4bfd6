"""From prepared dataset directories to packed training rows (blend + pack)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from longboat.core.data.blend import BlendedDataset
from longboat.core.data.packing import PackedDataset, Strategy
from longboat.llm.data.indexed import IndexedTokenDataset

__all__ = ["build_packed_dataset", "open_datasets"]


def open_datasets(paths: Sequence[str | Path]) -> list[IndexedTokenDataset]:
    """Open prepared datasets; they must share kind (pretrain/sft) and tokenizer."""
    if not paths:
        raise ValueError("no dataset paths given; pass at least one prepared dataset dir")
    datasets = [IndexedTokenDataset(p) for p in paths]
    first = datasets[0]
    for ds in datasets[1:]:
        for what, get in (
            ("kind", lambda m: m["kind"]),
            ("tokenizer", lambda m: m["fingerprint"]["tokenizer"]["sha256"]),
        ):
            if get(ds.manifest) != get(first.manifest):
                raise ValueError(
                    f"{ds.path} and {first.path} differ in {what} ({get(ds.manifest)!r} vs "
                    f"{get(first.manifest)!r}); blend datasets prepared the same way"
                )
    return datasets


def build_packed_dataset(
    paths: Sequence[str | Path],
    seq_len: int,
    *,
    weights: Sequence[float] | None = None,
    num_samples: int | None = None,
    seed: int = 0,
    strategy: Strategy = "best_fit",
    packed: bool = True,
) -> PackedDataset:
    """Packed rows of ``seq_len`` from one dataset or a weighted blend of several.

    With several ``paths`` (or ``weights``) documents are drawn through a
    :class:`~longboat.core.data.blend.BlendedDataset` (``num_samples`` documents, default the
    total, order from ``seed``). SFT datasets carry their loss masks into the rows. Padding
    uses the tokenizer's pad id (else EOS, else 0); it is never a label.
    """
    datasets = open_datasets(paths)
    docs = [ds.documents() for ds in datasets]
    if len(docs) == 1 and weights is None and num_samples is None:
        source = docs[0]
    else:
        source = BlendedDataset(
            docs,
            weights if weights is not None else [1.0] * len(docs),
            num_samples=num_samples,
            seed=seed,
        )
    m = datasets[0].manifest
    pad = m.get("pad_token_id")
    pad = pad if pad is not None else m.get("eos_token_id")
    return PackedDataset(
        source, seq_len, strategy=strategy, packed=packed, pad_id=0 if pad is None else int(pad)
    )

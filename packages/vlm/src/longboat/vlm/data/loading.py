"""One call from data files to packed rows: read, encode (with the report), pack."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from longboat.core.data.packing import Strategy
from longboat.vlm.data.conversations import read_conversations
from longboat.vlm.data.encoding import (
    EncodingReport,
    Overflow,
    SampleEncoder,
    encode_conversations,
    load_tokenizer,
)
from longboat.vlm.data.errors import DataError
from longboat.vlm.data.media import VideoOptions
from longboat.vlm.data.packing import PackedMultimodalDataset
from longboat.vlm.data.processor import QwenVisionProcessor

__all__ = ["load_packed_dataset"]


def load_packed_dataset(
    paths: str | Path | Sequence[str | Path],
    *,
    tokenizer: Any,
    processor: QwenVisionProcessor,
    seq_len: int,
    tokens_per_second: float,
    root: str | Path | None = None,
    skip_bad_samples: bool = False,
    overflow: Overflow = "error",
    video: VideoOptions | None = None,
    strategy: Strategy = "best_fit",
    packed: bool = True,
    log: Callable[[str], None] | None = None,
) -> tuple[PackedMultimodalDataset, EncodingReport]:
    """Packed rows of the conversations in ``paths`` and the encoding counters.

    ``tokenizer``: a loaded ``transformers`` tokenizer or a local tokenizer directory (its
    pad token pads the rows; else its EOS). ``root``: the folder media paths are relative
    to (default: each file's folder). The other arguments as in
    :func:`~longboat.vlm.data.encoding.encode_conversations` and
    :class:`~longboat.vlm.data.packing.PackedMultimodalDataset`.
    """
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad_id is None:
        raise DataError("the tokenizer has neither a pad nor an EOS token to pad rows with")
    items = [paths] if isinstance(paths, str | Path) else list(paths)
    conversations = [c for p in items for c in read_conversations(p, root=root)]
    encoder = SampleEncoder(tok, processor, video=video)
    samples, report = encode_conversations(
        conversations,
        encoder,
        max_len=seq_len,
        overflow=overflow,
        skip_bad_samples=skip_bad_samples,
    )
    if log is not None:
        counts = ", ".join(f"{k}={v}" for k, v in report.as_dict().items())
        log(f"multimodal data {', '.join(map(str, items))}: {counts}")
        for line in report.bad:
            log(f"  skipped: {line}")
    dataset = PackedMultimodalDataset(
        samples,
        encoder,
        seq_len=seq_len,
        pad_id=int(pad_id),
        tokens_per_second=tokens_per_second,
        strategy=strategy,
        packed=packed,
    )
    return dataset, report

"""Multimodal data: processors, conversations, packing.

- :mod:`~longboat.vlm.data.processor`: images / videos -> patches and grids (HF-equal).
- :mod:`~longboat.vlm.data.conversations`: LLaVA / ShareGPT JSON, JSON lines, Parquet records.
- :mod:`~longboat.vlm.data.media`: image, mp4 (PyAV) and frame-folder reading.
- :mod:`~longboat.vlm.data.encoding`: chat template, vision placeholders, assistant-only mask.
- :mod:`~longboat.vlm.data.packing`: packed rows with ``cu_seqlens`` and M-RoPE ids; resume.
- :mod:`~longboat.vlm.data.loading`: files -> packed rows in one call.
- :mod:`~longboat.vlm.data.shapes_dataset` / :mod:`~longboat.vlm.data.tiny_tokenizer`: the quickstart.
- :mod:`~longboat.vlm.data.errors`: errors naming the row, file and field.
"""

from longboat.vlm.data.conversations import Conversation, MediaRef, read_conversations
from longboat.vlm.data.encoding import (
    EncodedSample,
    EncodingReport,
    SampleEncoder,
    VisionTokens,
    encode_conversations,
    load_tokenizer,
)
from longboat.vlm.data.errors import (
    BadMediaError,
    DataError,
    PlaceholderCountError,
    SampleTooLongError,
)
from longboat.vlm.data.loading import load_packed_dataset
from longboat.vlm.data.media import VideoOptions
from longboat.vlm.data.packing import PackedMultimodalDataset, PackedRowStream
from longboat.vlm.data.processor import QwenVisionProcessor, VisionProcessorConfig

__all__ = [
    "BadMediaError",
    "Conversation",
    "DataError",
    "EncodedSample",
    "EncodingReport",
    "MediaRef",
    "PackedMultimodalDataset",
    "PackedRowStream",
    "PlaceholderCountError",
    "QwenVisionProcessor",
    "SampleEncoder",
    "SampleTooLongError",
    "VideoOptions",
    "VisionProcessorConfig",
    "VisionTokens",
    "encode_conversations",
    "load_packed_dataset",
    "load_tokenizer",
    "read_conversations",
]

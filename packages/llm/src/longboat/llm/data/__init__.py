"""Text data for the LLM stack: ``data prepare`` / ``data inspect`` and the indexed dataset.

- :mod:`~longboat.llm.data.prepare`: JSONL / Parquet / ``datasets`` dir -> indexed tokens.
- :mod:`~longboat.llm.data.indexed`: the memory-mapped :class:`IndexedTokenDataset`.
- :mod:`~longboat.llm.data.encoding`: pretrain encoding and SFT chat rendering + masks.
- Packing and blending are generic and live in ``longboat.core.data.packing`` / ``.blend``.
"""

from longboat.llm.data.indexed import IncompleteDatasetError, IndexedTokenDataset

__all__ = ["IncompleteDatasetError", "IndexedTokenDataset"]

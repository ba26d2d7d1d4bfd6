"""DeepSeek-V3.2 sparse attention (DSA): the lightning indexer and attention over the
selected keys, as Triton kernels with dense masked torch references.

- :func:`indexer_topk`: the ``topk`` best keys of each query (Triton scores, ``torch.topk``),
  scored in chunks of queries so that the ``[b, sq, sk]`` score matrix never exists whole;
  :func:`lightning_indexer`: the whole score matrix and the same keys.
- :func:`sparse_attention`: attention of ``h`` query heads over one shared key/value head
  restricted to the selected keys (MLA's absorbed form), forward and backward in Triton; a
  program covers one query and many heads, so each gathered key row serves them all.
- ``*_torch``: the references (dense score matrices, masked), which the kernels are tested
  against.
"""

import torch

from longboat.kernels._dispatch import resolve_impl
from longboat.kernels.dsa.indexer import (
    CHUNK_ELEMENTS,
    indexer_scores_triton,
    indexer_topk,
    lightning_indexer,
)
from longboat.kernels.dsa.reference import (
    causal_key_mask,
    indexer_scores_torch,
    lightning_indexer_torch,
    select_topk,
    selected_key_mask,
    sparse_attention_torch,
)
from longboat.kernels.dsa.sparse_attention import sparse_attention, sparse_attention_triton


def runs_triton(*tensors: torch.Tensor, impl: str | None = None) -> bool:
    """True when the DSA ops on ``tensors`` take the Triton path under ``impl`` (and the
    ``LONGBOAT_KERNELS_IMPL`` env): CUDA tensors, or any under Triton's interpreter."""
    return resolve_impl(impl, *tensors) == "triton"


__all__ = [
    "CHUNK_ELEMENTS",
    "causal_key_mask",
    "indexer_scores_torch",
    "indexer_scores_triton",
    "indexer_topk",
    "lightning_indexer",
    "lightning_indexer_torch",
    "runs_triton",
    "select_topk",
    "selected_key_mask",
    "sparse_attention",
    "sparse_attention_torch",
    "sparse_attention_triton",
]

"""DeepSeek-V3.2 sparse attention: the dense masked references against a per-query gather
computation (in process), and ``dsa_checks.py`` (the Triton kernels against the references,
run in a subprocess by ``run_checks``: under Triton's interpreter on CPU, compiled on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from longboat.kernels import dsa

CHECKS = "dsa_checks.py"


def test_sparse_attention_reference_equals_per_query_gather() -> None:
    """The dense masked reference equals, query by query, softmax over the gathered keys."""
    torch.manual_seed(0)
    b, s, heads, dk, dv, topk = 2, 12, 3, 10, 6, 4
    q, k, v = torch.randn(b, s, heads, dk), torch.randn(b, s, dk), torch.randn(b, s, dv)
    scores = torch.rand(b, s, s).masked_fill(~dsa.causal_key_mask(s, s, q.device), -torch.inf)
    idx = dsa.select_topk(scores, topk)
    out = dsa.sparse_attention_torch(q, k, v, idx, 0.3)
    for bi in range(b):
        for i in range(s):
            keys = idx[bi, i][idx[bi, i] >= 0]
            assert len(keys) == min(topk, i + 1) and bool((keys <= i).all())
            p = torch.softmax(q[bi, i] @ k[bi, keys].T * 0.3, dim=-1)  # [heads, n]
            torch.testing.assert_close(out[bi, i], p @ v[bi, keys], rtol=1e-6, atol=1e-6)


def test_indexer_reference_scores_and_topk() -> None:
    """Scores equal the formula; selection is the top of the visible keys, -1 beyond."""
    torch.manual_seed(1)
    q, k, w = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 2)
    scores, idx = dsa.lightning_indexer_torch(q, k, w, 3)
    i, j = 3, 1
    want = sum(w[0, i, h] * torch.relu(q[0, i, h] @ k[0, j]) for h in range(2))
    torch.testing.assert_close(scores[0, i, j], want)
    assert scores[0, 1, 2] == -torch.inf
    assert idx[0, 0].tolist() == [0, -1, -1] and idx[0, 1].sort().values.tolist() == [-1, 0, 1]
    assert set(idx[0, 4].tolist()) == set(scores[0, 4].topk(3).indices.tolist())


def test_dsa_kernels_match_reference_in_interpreter(
    run_checks: Callable[[str, str], None],
) -> None:
    run_checks(CHECKS, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dsa_kernels_match_reference_on_gpu(run_checks: Callable[[str, str], None]) -> None:
    run_checks(CHECKS, "cuda")

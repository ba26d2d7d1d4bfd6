"""DSA kernels (lightning indexer, sparse attention fwd + bwd) vs their dense masked torch
references.

Not collected by the default run (no ``test_`` prefix): ``test_dsa.py`` runs this file in a
subprocess, on CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported) at tiny shapes, or on CUDA (``LONGBOAT_KERNEL_TEST_DEVICE=cuda``) at a moderate
MLA-absorbed shape too (576-wide keys, 512-wide latent values, 256 keys per query).

Tolerances, as ``||kernel - ref|| / ||ref||`` on the same inputs: fp32 1e-5 for the output
and every gradient (the interpreter computes the same fp32 products; only the summation
order differs); bf16 2e-2 (probabilities and ``ds`` are rounded to bf16 before the tile dots,
as flash attention does, and the reference keeps them in fp32).
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("LONGBOAT_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU", allow_module_level=True)

from longboat.kernels import dsa  # noqa: E402  (after the interpreter check)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ON_GPU = DEVICE == "cuda"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def assert_same_selection(scores: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` and ``want`` select the same keys per query where the reference ``scores``
    separate the k-th best from the (k+1)-th by more than rounding (1e-5 of the row's largest
    score); at a tie or near-tie either choice is right, and the selected scores (read from
    ``scores``) must agree within that rounding instead."""
    topk = want.shape[-1]
    finite = scores.masked_fill(~torch.isfinite(scores), 0.0)
    eps = 1e-5 * finite.abs().amax(-1).clamp(min=1e-12)  # [b, sq]
    ordered = scores.sort(-1, descending=True).values
    ordered = torch.nn.functional.pad(ordered, (0, topk + 1), value=float("-inf"))
    cut, after = ordered[..., topk - 1], ordered[..., topk]
    clean = (cut - after > eps) | (cut == float("-inf"))  # -inf at the cut: every visible key
    same = torch.equal(got.sort(-1).values[clean], want.sort(-1).values[clean])
    assert same, "selected key sets differ where the cut is not a tie"
    picked = scores.gather(-1, got.clamp(min=0)).masked_fill(got < 0, -1e30).sort(-1).values
    wanted = scores.gather(-1, want.clamp(min=0)).masked_fill(want < 0, -1e30).sort(-1).values
    assert bool(((picked - wanted).abs() <= eps[..., None]).all()), "selected scores differ"
    assert int(clean.sum()) > clean.numel() // 2, "too many ties: the check says little"


INDEXER_SHAPES = [  # b, sq, sk, index heads, head dim, topk
    (2, 37, 37, 4, 16, 8),
    (1, 20, 45, 3, 24, 50),  # more keys than queries (bottom-right causal), topk > sk
    (1, 70, 70, 2, 64, 16),
]
if ON_GPU:
    INDEXER_SHAPES.append((2, 2048, 2048, 64, 128, 256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", INDEXER_SHAPES)
@pytest.mark.parametrize("relu", [True, False])
def test_indexer_matches_reference(shape, relu, dtype) -> None:  # type: ignore[no-untyped-def]
    """Scores within 1e-5 in fp32 from either input dtype (bf16 products are exact in fp32;
    only the summation order differs)."""
    b, sq, sk, heads, d, topk = shape
    torch.manual_seed(sq * sk + heads)
    q, k = randn(b, sq, heads, d, dtype=dtype), randn(b, sk, d, dtype=dtype)
    w = randn(b, sq, heads, dtype=dtype)
    scores, idx = dsa.lightning_indexer(q, k, w, topk, relu=relu, impl="triton")
    ref_scores, ref_idx = dsa.lightning_indexer_torch(q, k, w, topk, relu=relu)
    assert scores.dtype == torch.float32 and idx.shape == (b, sq, topk)
    visible = torch.isfinite(ref_scores)
    assert torch.equal(torch.isfinite(scores), visible), "causal mask differs"
    assert rel_err(scores[visible], ref_scores[visible]) <= 1e-5
    assert_same_selection(ref_scores, idx, ref_idx)
    # every selected key is visible, and -1 only where fewer than topk keys are
    rows = torch.arange(sq, device=DEVICE)[None, :, None] + (sk - sq)
    assert bool(((idx <= rows) | (idx == -1)).all())
    n_visible = visible.sum(-1, keepdim=True).clamp(max=topk)
    assert torch.equal((idx >= 0).sum(-1, keepdim=True), n_visible)


ATTN_SHAPES = [  # b, sq, sk, heads, dk, dv, topk, value_from_key
    (2, 14, 14, 3, 40, 24, 8, True),  # MLA absorbed: v = first dv channels of k
    (1, 19, 33, 5, 72, 40, 13, False),  # dk over two chunks, own v, 5 heads (one tile pads)
    (1, 9, 9, 18, 24, 24, 40, True),  # 18 heads: two head tiles; topk > sk
]
if ON_GPU:
    ATTN_SHAPES.append((1, 1024, 1024, 16, 576, 512, 256, True))


def _indices(b: int, sq: int, sk: int, topk: int) -> torch.Tensor:
    """Distinct causal keys per query from random scores (the indexer's output format),
    with ``-1`` where fewer than ``topk`` are visible; query 0 of sample 0 selects none."""
    scores = torch.rand(b, sq, sk, device=DEVICE)
    scores = scores.masked_fill(~dsa.causal_key_mask(sq, sk, scores.device), float("-inf"))
    idx = dsa.select_topk(scores, topk)
    idx[0, 0] = -1
    return idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_sparse_attention_matches_dense_masked_reference(dtype, shape) -> None:  # type: ignore[no-untyped-def]
    b, sq, sk, heads, dk, dv, topk, value_from_key = shape
    torch.manual_seed(sq + heads + dk)
    q = randn(b, sq, heads, dk, dtype=dtype).requires_grad_()
    k = randn(b, sk, dk, dtype=dtype).requires_grad_()
    v_own = randn(b, sk, dv, dtype=dtype).requires_grad_()
    idx = _indices(b, sq, sk, topk)
    leaves = [q, k] if value_from_key else [q, k, v_own]
    scale = dk**-0.5
    results = []
    for impl in ("torch", "triton"):
        for t in leaves:
            t.grad = None
        v = k[..., :dv] if value_from_key else v_own
        out = dsa.sparse_attention(q, k, v, idx, scale, impl=impl)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        (out.float() * torch.randn(out.shape, device=DEVICE, generator=gen)).sum().backward()
        results.append((out.detach(), [t.grad.clone() for t in leaves]))
    (ref, ref_grads), (got, got_grads) = results
    tol = TOL[dtype]
    assert got.dtype == dtype and got.shape == (b, sq, heads, dv)
    assert torch.isfinite(got).all()
    assert float(got[0, 0].abs().max()) == 0.0, "a query without keys outputs zeros"
    assert rel_err(got, ref) <= tol, f"out: {rel_err(got, ref):.2e}"
    for name, a, r in zip(("dq", "dk", "dv"), got_grads, ref_grads, strict=False):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert rel_err(a, r) <= tol, f"{name}: {rel_err(a, r):.2e}"


def test_indexer_selection_drives_the_attention() -> None:
    """End to end: the Triton indexer's keys, fed to the Triton attention, equal the dense
    reference over the reference indexer's keys (fp32)."""
    torch.manual_seed(5)
    b, s, heads, dk, dv = 1, 30, 4, 48, 32
    qi, ki, w = randn(b, s, 2, 16), randn(b, s, 16), randn(b, s, 2).abs()
    _, idx = dsa.lightning_indexer(qi, ki, w, 6, impl="triton")
    _, ref_idx = dsa.lightning_indexer_torch(qi, ki, w, 6)
    q, k = randn(b, s, heads, dk), randn(b, s, dk)
    got = dsa.sparse_attention(q, k, k[..., :dv], idx, 0.2, impl="triton")
    ref = dsa.sparse_attention_torch(q, k, k[..., :dv], ref_idx, 0.2)
    assert rel_err(got, ref) <= 1e-5


CHUNKED_INDEXER = [  # b, sq, sk, index heads, head dim, topk, chunk rows
    (2, 37, 37, 3, 16, 8, 10),  # chunks of 10 over 37 queries: the last one holds 7
    (1, 23, 41, 2, 24, 30, 6),  # more keys than queries; topk above what early rows see
    (1, 29, 17, 2, 16, 5, 4),  # fewer keys than queries: the first 12 queries see none
    (2, 9, 9, 2, 16, 16, 1),  # one query a chunk, topk > sk
]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("shape", CHUNKED_INDEXER)
def test_indexer_topk_in_chunks_selects_the_reference_keys(shape, impl) -> None:  # type: ignore[no-untyped-def]
    """``indexer_topk`` over chunks of queries (chunks that do not divide the sequence, each
    scored against its causal key prefix) selects the keys of the whole-matrix reference,
    ``-1`` exactly where fewer than ``topk`` keys are visible; on Triton the same keys as
    the unchunked kernel path, and chunk_rows=None (one chunk at these sizes) too (up to
    ties: ReLU scores tie at 0)."""
    b, sq, sk, heads, d, topk, rows = shape
    torch.manual_seed(sq + sk + rows)
    q, k, w = randn(b, sq, heads, d), randn(b, sk, d), randn(b, sq, heads)
    idx = dsa.indexer_topk(q, k, w, topk, impl=impl, chunk_rows=rows)
    ref_scores, ref_idx = dsa.lightning_indexer_torch(q, k, w, topk)
    assert idx.dtype == torch.int64 and idx.shape == (b, sq, topk)
    assert_same_selection(ref_scores, idx, ref_idx)
    visible = torch.isfinite(ref_scores).sum(-1).clamp(max=topk)
    assert torch.equal((idx >= 0).sum(-1), visible)
    if sk < sq:
        assert bool((idx[:, : sq - sk] == -1).all()), "queries that see no key select none"
    if impl == "triton":
        scores, whole = dsa.lightning_indexer(q, k, w, topk, impl="triton")
        assert_same_selection(scores, idx, whole)
        assert_same_selection(scores, dsa.indexer_topk(q, k, w, topk, impl="triton"), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_backward_in_chunks_of_rows(dtype) -> None:  # type: ignore[no-untyped-def]
    """The backward launched over chunks of query rows (7 rows over 2 x 13: chunks that span
    the two samples and do not divide them; one row a chunk) equals the dense masked
    reference within the tolerance, and its dq equals the one-launch dq bit for bit (each
    program owns its dq rows: the chunks change no sum); the output is a view of a
    head-major buffer."""
    b, s, heads, dk, dv, topk = 2, 13, 18, 40, 24, 6
    torch.manual_seed(11)
    q = randn(b, s, heads, dk, dtype=dtype).requires_grad_()
    k = randn(b, s, dk, dtype=dtype).requires_grad_()
    idx = _indices(b, s, s, topk)
    grads = {}
    for impl, rows in (("torch", None), ("triton", None), ("triton", 7), ("triton", 1)):
        q.grad = k.grad = None
        out = dsa.sparse_attention(q, k, k[..., :dv], idx, 0.25, impl=impl, chunk_rows=rows)
        if impl == "triton":
            assert out.permute(2, 0, 1, 3).is_contiguous(), "output not head-major"
        gen = torch.Generator(device=DEVICE).manual_seed(2)
        (out.float() * torch.randn(out.shape, device=DEVICE, generator=gen)).sum().backward()
        grads[(impl, rows)] = (out.detach(), q.grad.clone(), k.grad.clone())
    ref = grads[("torch", None)]
    for key in (("triton", None), ("triton", 7), ("triton", 1)):
        for name, a, r in zip(("out", "dq", "dk"), grads[key], ref, strict=True):
            assert a.dtype == dtype and rel_err(a, r) <= TOL[dtype], (key, name, rel_err(a, r))
        assert torch.equal(grads[key][1], grads[("triton", None)][1]), key


VALUE_LAYOUTS = [  # name, dk, dv
    ("model_view", 40, 24),  # MLA's layout: k and v views of one [s, b, 1, dk] key
    ("value_is_key", 24, 24),  # v is k itself: no channels past the value's
    ("detached_view", 40, 24),  # v reads k's memory but its gradient must not reach k
    ("own_value_narrow_key", 12, 20),  # a separate v wider than a key under 16 channels
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", VALUE_LAYOUTS, ids=lambda c: c[0])
def test_value_layouts_and_their_gradients(layout, dtype) -> None:  # type: ignore[no-untyped-def]
    """Where ``v`` lives (a view of the key, the key itself, a detached view of it, its own
    tensor) changes which rows the kernel gathers once and whether ``dv`` is added into
    ``dk`` inside the kernel; the gradient of every leaf equals the dense masked reference's
    (18 heads: two head blocks, one partial; 17 keys a query: a partial key block)."""
    name, dk, dv = layout
    b, s, heads, topk = 1, 18, 18, 17
    torch.manual_seed(dk + dv)
    q = randn(b, s, heads, dk, dtype=dtype).requires_grad_()
    key = randn(s, b, 1, dk, dtype=dtype).requires_grad_()  # megatron's [s, b, 1, d]
    own = randn(b, s, dv, dtype=dtype).requires_grad_()
    idx = _indices(b, s, s, topk)
    grads = []
    for impl in ("torch", "triton"):
        q.grad = key.grad = own.grad = None
        k = key[:, :, 0].transpose(0, 1)
        if name == "value_is_key":
            v = k
        elif name == "own_value_narrow_key":
            v = own
        else:
            v = k[..., :dv].detach() if name == "detached_view" else k[..., :dv]
        out = dsa.sparse_attention(q, k, v, idx, dk**-0.5, impl=impl)
        gen = torch.Generator(device=DEVICE).manual_seed(4)
        (out.float() * torch.randn(out.shape, device=DEVICE, generator=gen)).sum().backward()
        leaves = [q, key] + ([own] if name == "own_value_narrow_key" else [])
        grads.append((out.detach(), [t.grad.clone() for t in leaves]))
    (ref, ref_grads), (got, got_grads) = grads
    assert float(got[0, 0].abs().max()) == 0.0, "a query without keys outputs zeros"
    assert rel_err(got, ref) <= TOL[dtype], f"out: {rel_err(got, ref):.2e}"
    for i, (a, r) in enumerate(zip(got_grads, ref_grads, strict=True)):
        assert a.dtype == dtype and rel_err(a, r) <= TOL[dtype], (i, rel_err(a, r))


def test_indices_past_the_keys_select_nothing() -> None:
    """An index at or past ``sk`` is no key, as ``-1`` is (fp32): the output and dq equal
    those with ``-1`` in its place bit for bit, dk up to the order of its atomic adds."""
    torch.manual_seed(9)
    b, s, heads, dk, dv, topk = 1, 12, 4, 32, 16, 5
    q = randn(b, s, heads, dk).requires_grad_()
    k = randn(b, s, dk).requires_grad_()
    idx = _indices(b, s, s, topk)
    past = idx.clone()
    past[0, 5:, 0] = s + 3  # query 5 on would see key 0 twice otherwise: replace it
    minus = past.masked_fill(past >= s, -1)
    results = []
    for ids in (past, minus):
        q.grad = k.grad = None
        out = dsa.sparse_attention(q, k, k[..., :dv], ids, 0.2, impl="triton")
        out.square().sum().backward()
        results.append((out.detach(), q.grad.clone(), k.grad.clone()))
    (out, dq, dk), (out_m, dq_m, dk_m) = results
    assert torch.equal(out, out_m) and torch.equal(dq, dq_m)
    assert rel_err(dk, dk_m) <= 1e-6


if ON_GPU:  # defined on CUDA only (the CPU run must skip nothing)

    def _peak_above_start(fn):  # type: ignore[no-untyped-def]
        """(result of ``fn()``, peak bytes allocated above what was allocated before)."""
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - start

    def test_indexer_holds_one_chunk_of_scores_at_32k() -> None:
        """At 32K tokens ``indexer_topk`` allocates its int64 indices, one chunk of fp32
        scores and that chunk's top-k temporaries (~1.2 GiB), not the 4 GiB score matrix."""
        s, heads, d, topk = 32768, 64, 128, 2048
        q, k = randn(1, s, heads, d, dtype=torch.bfloat16), randn(1, s, d, dtype=torch.bfloat16)
        w = randn(1, s, heads, dtype=torch.bfloat16)
        idx, peak = _peak_above_start(lambda: dsa.indexer_topk(q, k, w, topk, impl="triton"))
        rows = dsa.CHUNK_ELEMENTS // s
        bound = 8 * s * topk + 4 * dsa.CHUNK_ELEMENTS + 21 * rows * topk + (64 << 20)
        assert peak <= bound < 4 * s * s, (peak, bound)
        assert bool((idx[0, -1] >= 0).all()) and bool((idx[0, 0, 1:] == -1).all())

    def test_sparse_backward_holds_no_fp32_dq_of_the_sequence() -> None:
        """MLA's absorbed shape at 16K tokens (128 heads, 576-wide keys, 512-wide values,
        2048 keys): the backward allocates dq in bf16 (accumulated in registers) and the
        fp32 dk (dv added into it: v is k's prefix) with its cast, plus, on the tuner's
        first call, Triton's 256 MB cache-flush buffer (within the ``4 * CHUNK_ELEMENTS``
        slack); the fp32 dq of the whole sequence (4.8 GB) and fp32 copies of dO and O
        never exist."""
        s, heads, dk, dv, topk = 16384, 128, 576, 512, 2048
        q = randn(1, s, heads, dk, dtype=torch.bfloat16, scale=0.1).requires_grad_()
        k = randn(1, s, dk, dtype=torch.bfloat16).requires_grad_()
        idx = _indices(1, s, s, topk)
        out = dsa.sparse_attention(q, k, k[..., :dv], idx, dk**-0.5, impl="triton")
        dout = torch.randn_like(out)
        _, peak = _peak_above_start(lambda: out.backward(dout))
        bound = 2 * s * heads * dk + 4 * dsa.CHUNK_ELEMENTS + 12 * s * (dk + dv) + (64 << 20)
        assert peak <= bound < 4 * s * heads * dk, (peak, bound)
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()

"""Attention dispatch: every CPU backend vs the explicit-softmax reference; masks; errors.

Tolerance: fp32, max abs error 1e-5 on outputs and gradients (FlexAttention has no CPU
backward, so flex is checked on the forward only here; its GPU backward is in the gpu test).
"""

from __future__ import annotations

import re

import pytest
import torch

from longboat import kernels as K
from longboat.kernels.attention import AttentionBackendUnavailableError

CPU_BACKENDS = ["sdpa", "sdpa_math", "eager", "flex"]
ATOL = 1e-5


def qkv(b: int, s: int, hq: int, hk: int, d: int = 16, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).requires_grad_() for h in (hq, hk, hk))


def explicit_softmax(q, k, v, allowed, scale=None):  # type: ignore[no-untyped-def]
    """Hand-written reference: per (b, h), softmax over allowed keys; GQA by head grouping."""
    b, _, hq, d = q.shape
    hk = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hk)
            sc = q[bi, :, h] @ k[bi, :, kh].T * scale
            sc = sc.masked_fill(~allowed[bi if allowed.shape[0] > 1 else 0], float("-inf"))
            out[bi, :, h] = torch.softmax(sc, -1) @ v[bi, :, kh]
    return out


def maybe_detach(backend: str, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FlexAttention refuses CPU inputs that require grad: run it on detached copies."""
    return tuple(t.detach() for t in ts) if backend == "flex" else ts


def grads(out, inputs):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(9)
    w = torch.randn(out.shape, generator=g)
    return torch.autograd.grad((out * w).sum(), inputs)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_dense_backends_match_reference(backend: str, causal: bool) -> None:
    q, k, v = qkv(2, 11, 4, 2)
    allowed = torch.ones(1, 11, 11, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    ref = explicit_softmax(q, k, v, allowed)
    out = K.attention(*maybe_detach(backend, q, k, v), causal=causal, backend=backend)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    if backend != "flex":
        for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_explicit_scale_reaches_every_backend(backend: str) -> None:
    # Every other test uses the default 1/sqrt(head_dim); a backend that dropped ``scale``
    # would pass them all.
    q, k, v = (t.detach() for t in qkv(1, 6, 2, 1, seed=4))
    allowed = torch.ones(1, 6, 6, dtype=torch.bool).tril()
    ref = explicit_softmax(q, k, v, allowed, scale=0.7)
    out = K.attention(q, k, v, causal=True, scale=0.7, backend=backend)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert (out - explicit_softmax(q, k, v, allowed)).abs().max() > 1e-2  # 0.7 != 1/sqrt(16)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_packed_documents_match_per_document_attention(backend: str) -> None:
    cu = torch.tensor([0, 3, 10, 12], dtype=torch.int32)
    q, k, v = (t[0] for t in qkv(1, 12, 4, 1, seed=1))  # packed [tokens, heads, dim]
    pieces = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (t[a:b][None] for t in (q, k, v))
        pieces.append(explicit_softmax(qs, ks, vs, torch.ones(1, b - a, b - a).tril().bool()))
    ref = torch.cat(pieces, dim=1)[0]
    out = K.attention(
        *maybe_detach(backend, q, k, v), causal=True, cu_seqlens=cu, max_seqlen=7, backend=backend
    )
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    if backend != "flex":
        for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_prefix_lm_mask_matches_reference(backend: str) -> None:
    prefix = torch.tensor([4, 7])
    mask = K.prefix_lm_mask(prefix, 9)
    # By hand: query i sees key j iff j < prefix (bidirectional prefix) or j <= i (causal).
    i, j = torch.meshgrid(torch.arange(9), torch.arange(9), indexing="ij")
    for bi, p in enumerate(prefix.tolist()):
        assert torch.equal(mask[bi, 0], (j < p) | (j <= i))
    q, k, v = qkv(2, 9, 2, 2, seed=2)
    ref = explicit_softmax(q, k, v, mask[:, 0])
    out = K.attention(*maybe_detach(backend, q, k, v), causal=False, mask=mask, backend=backend)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_flex_block_masks_match_dense() -> None:
    prefix = torch.tensor([3, 5])
    q, k, v = (t.detach() for t in qkv(2, 8, 2, 2, seed=3))
    ref = explicit_softmax(q, k, v, K.prefix_lm_mask(prefix, 8)[:, 0])
    out = K.attention(q, k, v, causal=False, mask=K.prefix_lm_block_mask(prefix, 8))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)  # auto picks flex for a BlockMask
    cu = torch.tensor([0, 5, 8])
    bm = K.document_block_mask(cu, causal=True)
    dense = K.document_mask(cu, causal=True)
    q1, k1, v1 = (t[:1] for t in (q, k, v))
    torch.testing.assert_close(
        K.attention(q1, k1, v1, causal=False, mask=bm),
        explicit_softmax(q1, k1, v1, dense[0]),
        atol=ATOL,
        rtol=0,
    )


def test_block_causal_mask_semantics() -> None:
    # pi0-style blocks: prefix (0,0,0), state (1), actions (2,2): bidirectional inside a block.
    ids = torch.tensor([[0, 0, 0, 1, 2, 2]])
    m = K.block_causal_mask(ids)[0, 0]
    assert m[0].tolist() == [True, True, True, False, False, False]
    assert m[3].tolist() == [True, True, True, True, False, False]
    assert m[4].tolist() == [True] * 6
    valid = torch.tensor([[True] * 5 + [False]])
    assert not K.block_causal_mask(ids, valid=valid)[0, 0, :, 5].any()


def test_auto_backend_choice_on_cpu() -> None:
    q = torch.zeros(1, 4, 2, 8)
    assert K.select_backend(q) == "sdpa"
    assert K.select_backend(q, mask=K.prefix_lm_block_mask(torch.tensor([2]), 4)) == "flex"


def test_packed_fp32_documents_on_cuda_go_to_sdpa_not_a_flash_kernel() -> None:
    """The flash varlen kernels take only fp16 / bf16: an fp32 run (train.precision=fp32) of
    packed documents on a GPU uses sdpa with the documents' mask; half precision uses the first
    flash kernel present."""
    assert K.auto_backend(True, torch.float32, packed=True) == "sdpa"
    half = K.auto_backend(True, torch.bfloat16, packed=True)
    flash = [b for b in ("flash_attn", "te", "varlen") if K.backend_available(b)]
    assert half == (flash[0] if flash else "flex")
    assert K.auto_backend(True, torch.float32, packed=False) == "sdpa"
    assert K.auto_backend(False, torch.bfloat16, packed=True) == "sdpa"


@pytest.mark.parametrize(
    "backend,extra",
    [("flash_attn", "longboat-kernels[flash-attn]"), ("te", "longboat-kernels[te]")],
)
def test_forced_missing_backend_says_what_to_install(backend: str, extra: str) -> None:
    if K.backend_available(backend):
        pytest.skip(f"{backend} is installed here")
    q, k, v = qkv(1, 4, 2, 2)
    with pytest.raises(AttentionBackendUnavailableError, match=re.escape(f"pip install {extra}")):
        K.attention(q, k, v, causal=True, backend=backend)


def test_bad_inputs_raise() -> None:
    q, k, v = qkv(1, 4, 3, 2)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        K.attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="backend='nope' is unknown"):
        K.attention(q, q, q, causal=True, backend="nope")
    with pytest.raises(ValueError, match="need cu_seqlens"):
        K.attention(q[0], q[0], q[0], causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex"])
def test_gpu_backends_match_eager(backend: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(
            2, 256, h, 64, device="cuda", generator=g, dtype=torch.bfloat16
        ).requires_grad_()
        for h in (8, 2, 2)
    )
    ref = K.attention(q, k, v, causal=True, backend="eager")
    out = K.attention(q, k, v, causal=True, backend=backend)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    w = torch.randn(out.shape, device="cuda", generator=g)
    ga = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    gb = torch.autograd.grad((ref.float() * w).sum(), (q, k, v))
    for a, b in zip(ga, gb, strict=True):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["varlen", "flex", None])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_packed_documents_match_eager(backend: str | None, causal: bool) -> None:
    """Packed documents through torch's varlen kernel (and flex, and the auto choice) equal
    the eager reference with the dense document mask, forward and backward (GQA 8 / 2)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    cu = torch.tensor([0, 100, 101, 300, 512], dtype=torch.int32, device="cuda")
    q, k, v = (
        torch.randn(512, h, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        for h in (8, 2, 2)
    )
    ref = K.attention(q, k, v, causal=causal, cu_seqlens=cu, backend="eager")
    out = K.attention(q, k, v, causal=causal, cu_seqlens=cu, backend=backend)
    assert out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    w = torch.randn(out.shape, device="cuda", generator=g)
    ga = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    gb = torch.autograd.grad((ref.float() * w).sum(), (q, k, v))
    for a, b in zip(ga, gb, strict=True):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_packed_fp32_documents_auto_match_eager() -> None:
    """fp32 packed documents on CUDA (train.precision=fp32) run through the automatic choice
    and equal the eager reference, forward and backward (GQA 8 / 2, head dim 16)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    cu = torch.tensor([0, 40, 41, 96], dtype=torch.int32, device="cuda")
    q, k, v = (
        torch.randn(96, h, 16, device="cuda", generator=g).requires_grad_() for h in (8, 2, 2)
    )
    assert K.select_backend(q, cu_seqlens=cu) == "sdpa"
    ref = K.attention(q, k, v, causal=True, cu_seqlens=cu, backend="eager")
    out = K.attention(q, k, v, causal=True, cu_seqlens=cu)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    w = torch.randn(out.shape, device="cuda", generator=g)
    ga = torch.autograd.grad((out * w).sum(), (q, k, v))
    gb = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(ga, gb, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 1e-4


def test_varlen_backend_needs_packed_cuda_inputs() -> None:
    q, k, v = qkv(1, 8, 2, 2)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert K.backend_available("varlen")  # the locked torch (>= 2.9) has the kernel
    with pytest.raises(ValueError, match="cu_seqlens and CUDA"):
        K.attention(q, k, v, causal=True, cu_seqlens=cu, backend="varlen")

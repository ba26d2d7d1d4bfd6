"""DeepSeek-V3.2 sparse attention: the dense masked references against a per-query gather
computation (in process), and ``dsa_checks.py`` (the Triton kernels against the references,
run in a subprocess by ``run_checks``: under Triton's interpreter on CPU, compiled on CUDA),
and the sparse-attention kernels compiled for sm_90 without a GPU (what the interpreter does
not check).
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


def _compile_for_hopper(kind: str, tile: tuple[int, int, int, int], dtype: str, *,
                        dk: int, dv: int, v_in_k: bool) -> int:  # fmt: skip
    """Compile the package's sparse-attention kernel ``kind`` ("fwd" / "bwd") for sm_90 with
    ``tile`` (BLOCK_H, BLOCK_T, warps, stages) as the launch would; returns its shared
    memory in bytes. Needs no GPU: Triton's CUDA backend and its ptxas."""
    import sys

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = sys.modules["longboat.kernels.dsa.sparse_attention"]
    fn = (mod._sparse_attn_fwd_kernel if kind == "fwd" else mod._sparse_attn_bwd_kernel).fn
    bh, bt, warps, stages = tile
    split, block_a = mod._channel_split(dk, dv, v_in_k)
    block_b, block_v = max(16, mod.next_pow2(max(1, dk - split))), max(16, mod.next_pow2(dv))
    const = dict(V_IN_K=v_in_k, HAS_TAIL=dk > split, BLOCK_KA=block_a, BLOCK_KB=block_b,
                 BLOCK_DV=block_v, A_FULL=block_a == split, B_FULL=block_b == dk - split,
                 V_FULL=block_v == dv, IEEE=dtype == "fp32", BLOCK_H=bh, BLOCK_T=bt)  # fmt: skip
    if kind == "bwd":
        const.update(DV_INTO_DK=v_in_k, DK_ROWS=bh < 64)
    pointers = {"IDX": "*i64", "LSE": "*fp32", "DK_": "*fp32", "DV_": "*fp32"}
    signature = {}
    for name in fn.arg_names:
        if name in const:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "OUT", "DO", "DQ"):
            signature[name] = f"*{dtype}"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name.startswith("scale") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if signature[n].startswith("*")}  # fmt: skip
    constexprs = {(fn.arg_names.index(k),): v for k, v in const.items()}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    return int(compiled.metadata.shared)


HOPPER_SHARED = 227 * 1024  # an H100 block's largest dynamic shared memory


@pytest.mark.parametrize(
    ("kind", "tile", "dtype", "shape"),
    [
        ("fwd", (64, 32, 8, 2), "bf16", (576, 512, True)),  # MLA at 64 heads: wgmma tiles
        ("bwd", (64, 16, 8, 2), "bf16", (576, 512, True)),  # dk tile as [channels, keys]
        ("bwd", (32, 16, 8, 2), "bf16", (576, 512, True)),  # dk tile as [keys, channels]
        ("fwd", (16, 16, 4, 1), "fp32", (72, 40, False)),  # the GPU checks' fp32 own-value
        ("bwd", (16, 16, 4, 1), "fp32", (40, 24, True)),  # fp32, partial channel tiles
    ],
)
def test_sparse_attention_kernels_compile_for_hopper(kind, tile, dtype, shape) -> None:  # type: ignore[no-untyped-def]
    """The interpreter runs the kernels as Python and misses what only the compiler checks
    (a return type per static branch, shared memory): each compiles for sm_90 within an
    H100's shared memory, at MLA's widths with the tuner's leading candidates and at the
    small fp32 widths of the GPU checks."""
    dk, dv, v_in_k = shape
    shared = _compile_for_hopper(kind, tile, dtype, dk=dk, dv=dv, v_in_k=v_in_k)
    assert 0 < shared <= HOPPER_SHARED, shared

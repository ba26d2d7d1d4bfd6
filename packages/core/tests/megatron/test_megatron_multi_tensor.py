"""megatron's gradient norm and clipping through torch's fused _foreach kernels."""

from __future__ import annotations

import warnings

import pytest
import torch

from longboat.core.distributed import run_multiprocess

pytest.importorskip("megatron.core", reason="needs longboat-core[megatron]")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core.utils as mutils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

from longboat.core.megatron.multi_tensor import (
    foreach_l2_norm,
    foreach_scale,
    multi_tensor_fallbacks,
)


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in [(3, 5), (7,), (2, 2, 4), (1,)]]


def test_l2_norm_equals_megatrons_fallback() -> None:
    ts = _tensors()
    flag = torch.zeros(1, dtype=torch.int)
    expect = torch.linalg.vector_norm(torch.cat([t.flatten() for t in ts]))
    total, per = foreach_l2_norm(2048, flag, [ts], True)
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total[0], expect, rtol=1e-6, atol=0)
    torch.testing.assert_close(per, torch.stack([t.norm() for t in ts]), rtol=1e-6, atol=0)
    # bf16 gradients are summed in fp32
    bf = [t.to(torch.bfloat16) for t in ts]
    total_bf, _ = foreach_l2_norm(2048, flag, [bf], False)
    ref = torch.linalg.vector_norm(torch.cat([t.float().flatten() for t in bf]))
    torch.testing.assert_close(total_bf[0], ref, rtol=1e-6, atol=0)
    empty, _ = foreach_l2_norm(2048, flag, [[]], False)
    assert empty.tolist() == [0.0]


def test_scale_in_place_copy_and_cast() -> None:
    flag = torch.zeros(1, dtype=torch.int)
    ts = _tensors(1)
    before = [t.clone() for t in ts]
    foreach_scale(2048, flag, [ts, ts], 0.25)
    for t, b in zip(ts, before, strict=True):
        torch.testing.assert_close(t, b * 0.25, rtol=0, atol=0)
    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in ts]
    foreach_scale(2048, flag, [ts, dst], 1.0)
    for t, d in zip(ts, dst, strict=True):
        assert torch.equal(d, t.to(torch.bfloat16))
    foreach_scale(2048, flag, [ts, dst], 2.0)
    for t, d in zip(ts, dst, strict=True):
        assert torch.equal(d, (t * 2.0).to(torch.bfloat16))
    with pytest.raises(ValueError, match="3 sources for 4 destinations"):
        foreach_scale(2048, flag, [ts[:3], dst], 1.0)


def test_installed_only_over_megatrons_local_fallback_and_undone() -> None:
    before = {m: (m.l2_norm_impl if hasattr(m, "l2_norm_impl") else None,
                  m.multi_tensor_scale_impl) for m in (clip_grads, moptimizer)}  # fmt: skip
    patches = multi_tensor_fallbacks()
    try:
        if before[clip_grads][0] is mutils.local_multi_tensor_l2_norm:
            assert clip_grads.l2_norm_impl is foreach_l2_norm
            assert clip_grads.multi_tensor_scale_impl is foreach_scale
            assert moptimizer.multi_tensor_scale_impl is foreach_scale
        else:  # apex / Transformer Engine kernels stay
            assert clip_grads.l2_norm_impl is before[clip_grads][0]
    finally:
        patches.undo()
    after = {m: (m.l2_norm_impl if hasattr(m, "l2_norm_impl") else None,
                 m.multi_tensor_scale_impl) for m in (clip_grads, moptimizer)}  # fmt: skip
    assert after == before


def _clip_worker(rank: int, world: int) -> dict[str, object]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=7)
    try:
        installed = clip_grads.l2_norm_impl is foreach_l2_norm
        ps = [torch.nn.Parameter(torch.zeros_like(t)) for t in _tensors(2)]
        for p, g in zip(ps, _tensors(2), strict=True):
            p.grad = g * (rank + 1)
        norm = clip_grads.get_grad_norm_fp32([p.grad for p in ps])
        clip_grads.clip_grad_by_total_norm_fp32(ps, max_norm=1.0, total_norm=norm)
        clipped = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ps])))
        return {"installed": installed, "norm": float(norm), "clipped": clipped}
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_megatron_clips_through_the_fused_kernels_at_world_size_2() -> None:
    outs = run_multiprocess(_clip_worker, 2)
    ref = torch.linalg.vector_norm(torch.cat([t.flatten() for t in _tensors(2)]))
    # no group given: the squared norms are summed over the world (ranks hold g and 2 g)
    # clipped to a global norm of 1: the ranks keep their 1 : 2 share
    for rank, out in enumerate(outs):
        assert out["installed"] is True
        assert out["norm"] == pytest.approx(float(ref) * 5**0.5, rel=1e-6)
        assert out["clipped"] == pytest.approx((rank + 1) / 5**0.5, rel=1e-5)
    assert clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm  # the parent is untouched

"""Ulysses context parallelism of the Wan DiT: CP=2 equals CP=1 (gloo, CPU, fp32).

The same weights run a dense batch (45 tokens per sample: the sequence is padded to a multiple
of CP), a packed call of two samples of different sizes (123 tokens; a rank's slice starts in
the middle of the second sample), and a backward of a loss on each: outputs and the
CP-summed parameter gradients equal one process within 1e-5; with recompute of every block
too. The all-to-all helpers round-trip exactly, and a head count CP does not divide is a
``ConfigError`` naming ``parallel.context_parallel``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.distributed import run_multiprocess
from longboat.diffusion.models.wan.config import flavor
from longboat.diffusion.parallel.ulysses import ContextShard, local_segments

CP_TOL = 1e-5

CFG = flavor("tiny").replace(num_attention_heads=4, attention_head_dim=8)
C = CFG.in_channels
DENSE_SHAPE = (2, C, 3, 6, 10)  # grid 3 x 3 x 5 = 45 tokens per sample
PACKED = [(C, 3, 8, 8), (C, 5, 6, 10)]  # 48 + 75 = 123 tokens


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _set_weights(model: torch.nn.Module) -> None:
    """Seeded random weights (the zero-initialised output head too, so every gradient moves)."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)


def _inputs() -> dict[str, Any]:
    text = _randn(2, 6, CFG.text_dim, seed=3)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    return {
        "dense": _randn(*DENSE_SHAPE, seed=1),
        "packed": [_randn(*s, seed=5 + i) for i, s in enumerate(PACKED)],
        "timesteps": torch.tensor([120.0, 870.0]),
        "text": text,
        "mask": mask,
    }


def _worker(rank: int, world: int, recompute: int) -> dict[str, Any]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.diffusion.models.wan.model import build

    parallel_state.initialize(
        ParallelConfig(context_parallel=world), get_accelerator("cpu"), seed=3
    )
    try:
        model = build(CFG.replace(recompute_blocks=recompute))
        _set_weights(model)
        x = _inputs()
        out: dict[str, Any] = {"tokens_here": []}
        hook = model.patch_embedding.register_forward_hook(
            lambda m, args, y: out["tokens_here"].append(args[0].shape[1])
        )
        dense = model(x["dense"], x["timesteps"], x["text"], x["mask"])
        packed = model(x["packed"], x["timesteps"], x["text"], x["mask"])
        hook.remove()
        target = _randn(*DENSE_SHAPE, seed=9)
        loss = (dense - target).pow(2).mean() + sum((p - 0.5).pow(2).mean() for p in packed)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.detach().clone()
            if world > 1:  # each rank holds its tokens' contribution
                torch.distributed.all_reduce(g)
            grads[name] = g
        out.update(dense=dense.detach(), packed=[p.detach() for p in packed], loss=loss.detach())
        out["grads"] = grads
        return out
    finally:
        parallel_state.destroy()


def _a2a_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from longboat.diffusion.parallel.ulysses import (
        gather_tokens,
        heads_to_seq,
        seq_to_heads,
        shard_tokens,
    )

    group = dist.group.WORLD
    full = _randn(2, 7, 4, 3, seed=21)  # [B, S, H, D]; 7 tokens over 2 ranks: one pad token
    shard = ContextShard.of(7, group)
    local = shard_tokens(full, shard).requires_grad_(True)
    heads = seq_to_heads(local, shard)
    back = heads_to_seq(heads, shard)
    gathered = gather_tokens(back, shard)
    (gathered * torch.arange(7.0)[None, :, None, None]).sum().backward()
    return {"heads": heads.detach(), "back": back.detach(), "local": local.detach(),
            "gathered": gathered.detach(), "grad": local.grad}  # fmt: skip


@pytest.fixture(scope="module")
def cp1() -> dict[str, Any]:
    return run_multiprocess(_worker, 1, 0, timeout=300)[0]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.multiprocess
@pytest.mark.parametrize("recompute", [0, -1], ids=["plain", "recompute"])
def test_cp2_equals_cp1(cp1: dict[str, Any], recompute: int) -> None:
    outs = run_multiprocess(_worker, 2, recompute, timeout=300)
    assert cp1["tokens_here"] == [45, 123]
    for out in outs:
        assert out["tokens_here"] == [23, 62]  # each rank embeds its slice of the padded tokens
        assert _max_diff(out["dense"], cp1["dense"]) < CP_TOL
        for a, b in zip(out["packed"], cp1["packed"], strict=True):
            assert _max_diff(a, b) < CP_TOL
        assert abs(float(out["loss"]) - float(cp1["loss"])) < CP_TOL
        assert out["grads"].keys() == cp1["grads"].keys()
        worst = max(_max_diff(out["grads"][k], cp1["grads"][k]) for k in cp1["grads"])
        assert worst < CP_TOL, worst
    # the gradients are not trivially zero
    assert min(float(g.abs().max()) for g in cp1["grads"].values()) > 0


@pytest.mark.multiprocess
def test_all_to_all_round_trip_and_gradients() -> None:
    full = _randn(2, 7, 4, 3, seed=21)
    outs = run_multiprocess(_a2a_worker, 2, timeout=120)
    for rank, out in enumerate(outs):
        # seq_to_heads: all 7 tokens, this rank's 2 of the 4 heads; heads_to_seq undoes it
        assert torch.equal(out["heads"], full[:, :, 2 * rank : 2 * rank + 2])
        assert torch.equal(out["back"], out["local"])
        assert torch.equal(out["gathered"], full)
        # d(sum(t * x_t))/dx: the token index on this rank's real tokens, 0 on the pad token
        expect = torch.zeros(2, 4, 4, 3)
        for i in range(4):
            t = 4 * rank + i
            if t < 7:
                expect[:, i] = float(t)
        assert torch.equal(out["grad"], expect)


def test_local_segments_cover_each_sample_once() -> None:
    lengths = [48, 75]
    shards = [ContextShard(group=None, size=4, rank=r, length=123) for r in range(4)]
    segs = [local_segments(lengths, s) for s in shards]
    assert segs == [(31, 0), (17, 14), (0, 31), (0, 31)]  # 124 slots: the last holds a pad
    assert [sum(s) for s in segs] == [31] * 4
    real = [sum(s[i] for s in segs) for i in range(2)]
    assert real[0] == 48 and real[1] == 75 + 1


def _bad_heads_worker(rank: int, world: int) -> str:
    from longboat.core.config.errors import ConfigError
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.diffusion.models.wan.model import build

    parallel_state.initialize(ParallelConfig(context_parallel=2), get_accelerator("cpu"))
    try:
        build(CFG.replace(num_attention_heads=3))
    except ConfigError as exc:
        return str(exc)
    finally:
        parallel_state.destroy()
    return "no error"


@pytest.mark.multiprocess
def test_heads_not_divisible_by_cp_is_a_config_error() -> None:
    message = run_multiprocess(_bad_heads_worker, 2, timeout=120)[0]
    assert "parallel.context_parallel" in message and "num_attention_heads=3" in message

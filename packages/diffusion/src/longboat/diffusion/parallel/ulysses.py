"""Ulysses context parallelism over a DiT's tokens.

A DiT block is per-token everywhere but in self-attention: modulation, norms, the
feed-forward and the cross-attention to the caption read one token at a time. So each rank of
a context-parallel (CP) group keeps a contiguous slice of the (padded) token sequence for the
whole block, and self-attention trades slices for heads with one all-to-all
(``seq_to_heads``: every rank then holds the full sequence for ``heads / cp`` of the heads),
attends, and trades back (``heads_to_seq``). The attention itself is unchanged: dense rows or
varlen ``cu_seqlens`` of packed samples see their full sequences.

``ContextShard`` describes one rank's slice: the sequence of ``length`` tokens is padded to
``padded = cp * local`` and rank ``r`` holds tokens ``[r * local, (r + 1) * local)``. The padded
tail never reaches attention (dropped after ``seq_to_heads``, zeros before ``heads_to_seq``),
and ``gather_tokens`` drops it from the output.

Gradients: ``seq_to_heads`` / ``heads_to_seq`` are each other's backward. ``gather_tokens``
gives every rank the full output, so every rank computes the same loss; its backward keeps this
rank's slice of the gradient, so a parameter's gradient on a rank is the contribution of that
rank's tokens, and the sum over the CP group is the full gradient (megatron's DDP averages over
data x context parallel ranks: a training step multiplies its loss by ``cp``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ContextShard",
    "context_shard",
    "gather_tokens",
    "heads_to_seq",
    "local_segments",
    "seq_to_heads",
    "shard_tokens",
]


@dataclass(frozen=True)
class ContextShard:
    """One rank's slice of a token sequence under context parallelism (module doc)."""

    group: Any
    """The context-parallel process group."""
    size: int
    """Ranks in the group (``cp``)."""
    rank: int
    """This rank's index in the group."""
    length: int
    """Real tokens of the sequence."""

    @classmethod
    def of(cls, length: int, group: Any) -> ContextShard:
        """This rank's shard of a ``length``-token sequence over ``group``."""
        return cls(
            group=group, size=dist.get_world_size(group), rank=dist.get_rank(group), length=length
        )

    @property
    def local(self) -> int:
        """Tokens per rank: ``ceil(length / cp)``."""
        return -(-self.length // self.size)

    @property
    def padded(self) -> int:
        """``cp * local``: the sequence padded to a multiple of ``cp``."""
        return self.local * self.size

    @property
    def start(self) -> int:
        """First (padded) token of this rank."""
        return self.rank * self.local


def context_shard(length: int, group: Any = None) -> ContextShard | None:
    """The shard of a ``length``-token sequence for this rank of ``group`` (megatron's CP group
    when None); None without context parallelism."""
    if group is None:
        from megatron.core import parallel_state as mps

        if mps.get_context_parallel_world_size() == 1:
            return None
        group = mps.get_context_parallel_group()
    if dist.get_world_size(group) == 1:
        return None
    return ContextShard.of(int(length), group)


def _pad(x: torch.Tensor, dim: int, to: int) -> torch.Tensor:
    extra = to - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def shard_tokens(x: torch.Tensor, shard: ContextShard, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` (every rank holds the full ``x``): zero-padded along ``dim``
    to ``shard.padded``, then the slice ``[start, start + local)``. Its gradient flows back to
    that slice of ``x`` only."""
    if x.shape[dim] != shard.length:
        raise ValueError(
            f"shard_tokens: {x.shape[dim]} tokens along dim {dim}, expected {shard.length}"
        )
    return _pad(x, dim, shard.padded).narrow(dim, shard.start, shard.local)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: ContextShard, dim: int) -> torch.Tensor:
        ctx.shard, ctx.dim = shard, dim
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x.contiguous(), group=shard.group)
        return torch.cat(parts, dim=dim).narrow(dim, 0, shard.length)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        shard, dim = ctx.shard, ctx.dim
        # Every rank computed the same loss from the full output: keep this rank's slice.
        mine = _pad(grad, dim, shard.padded).narrow(dim, shard.start, shard.local)
        return mine.contiguous(), None, None


def gather_tokens(x: torch.Tensor, shard: ContextShard, dim: int = 1) -> torch.Tensor:
    """The full sequence (``shard.length`` tokens along ``dim``, padding dropped) from every
    rank's slice ``x``; backward keeps this rank's slice of the gradient (module doc)."""
    return _Gather.apply(x, shard, dim)


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _s2h(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    # [B, local, H, D] -> chunk j of the heads to rank j -> [B, padded, H / cp, D]
    b, s, h, d = x.shape
    p = shard.size
    send = x.reshape(b, s, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _all_to_all(send, shard.group)  # [p, B, local, H / p, D]: rank i's tokens
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * s, h // p, d)


def _h2s(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    # [B, padded, H / cp, D] -> slice i of the tokens to rank i -> [B, local, H, D]
    b, s, hp, d = x.shape
    p = shard.size
    send = x.reshape(b, p, s // p, hp, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = _all_to_all(send, shard.group)  # [p, B, local, H / p, D]: rank i's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // p, p * hp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        ctx.shard = shard
        return _s2h(x, shard)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _h2s(grad, ctx.shard), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        ctx.shard = shard
        return _h2s(x, shard)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _s2h(grad, ctx.shard), None


def seq_to_heads(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """``[B, local, H, D]`` (this rank's tokens, all heads) -> ``[B, length, H / cp, D]`` (all
    real tokens, this rank's heads: ``[rank * H / cp, (rank + 1) * H / cp)``)."""
    if x.dim() != 4 or x.shape[1] != shard.local or x.shape[2] % shard.size:
        raise ValueError(
            f"seq_to_heads: expected [B, {shard.local}, H, D] with H divisible by "
            f"cp={shard.size}, got {tuple(x.shape)}"
        )
    return _SeqToHeads.apply(x, shard).narrow(1, 0, shard.length)


def heads_to_seq(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: ``[B, length, H / cp, D]`` -> ``[B, local, H, D]``."""
    if x.dim() != 4 or x.shape[1] != shard.length:
        raise ValueError(
            f"heads_to_seq: expected [B, {shard.length}, H / cp, D], got {tuple(x.shape)}"
        )
    return _HeadsToSeq.apply(_pad(x, 1, shard.padded), shard)


def local_segments(lengths: Sequence[int], shard: ContextShard) -> tuple[int, ...]:
    """How many of this rank's tokens belong to each of the packed samples of ``lengths``
    (their token counts, in order); the padded tail counts for the last sample (its output is
    dropped, its values only have to be finite)."""
    if sum(lengths) != shard.length:
        raise ValueError(
            f"local_segments: samples of {sum(lengths)} tokens, shard of {shard.length}"
        )
    lo, hi = shard.start, shard.start + shard.local
    out, at = [], 0
    for n in lengths:
        out.append(max(0, min(hi, at + n) - max(lo, at)))
        at += n
    out[-1] += max(0, hi - max(lo, shard.length))
    return tuple(out)

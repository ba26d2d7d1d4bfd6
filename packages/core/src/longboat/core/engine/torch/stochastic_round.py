"""Stochastic rounding of fp32 values to bf16 with counter-based noise (no RNG state).

``x`` rounds to bf16 by adding 16 random low bits to its fp32 bit pattern and truncating:
it becomes the bf16 value above ``|x|`` with probability (distance to the one below) / ulp,
so the rounding is unbiased (``E[round(x)] = x``) and small updates that round-to-nearest
would drop survive on average. A NaN becomes the canonical quiet NaN.

The noise of element ``i`` at optimizer step ``s`` of a run seeded ``seed`` is
``hash32((i mod 2**32) xor key(seed, s)) & 0xFFFF`` (``hash32``: an integer mixer of
xor-shifts and multiplies on 32-bit words), so it needs no generator state: a resumed run
draws exactly the noise of an uninterrupted one, and the torch path here and longboat's
Triton AdamW kernel (``longboat.kernels.adamw_master_step_``, which computes the same
function in int64 arithmetic) round alike, bit for bit. ``MasterWeightAdamW(master_storage=
"bf16_sr")`` stores its weights this way.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

MASK32 = 0xFFFFFFFF
HASH_MUL1 = 0x7FEB352D
"""First multiplier of ``hash32`` (below 2**31: the int64 products stay exact)."""
HASH_MUL2 = 0x5BD1E995
"""Second multiplier of ``hash32`` (below 2**31)."""
SEED_MIX = 0x2545F491
"""Odd constant the seed is mixed with before the step is added."""


def hash32(x: Tensor) -> Tensor:
    """The 32-bit mixer on int64 tensors holding values in [0, 2**32) (new tensor)."""
    x = x ^ (x >> 16)
    x = (x * HASH_MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * HASH_MUL2) & MASK32
    return x ^ (x >> 16)


def _hash32_int(x: int) -> int:
    """``hash32`` of one Python int in [0, 2**32)."""
    x ^= x >> 16
    x = (x * HASH_MUL1) & MASK32
    x ^= x >> 15
    x = (x * HASH_MUL2) & MASK32
    return x ^ (x >> 16)


def step_key(seed: int, step: Tensor) -> Tensor:
    """The per-step noise key (a 0-d int64 tensor on ``step``'s device, in [0, 2**32)):
    ``hash32((hash32(seed ^ SEED_MIX) + step) mod 2**32)``; ``step`` is the optimizer's step
    count (any numeric 0-d tensor, already counting this step). Device ops only, with no host
    read (capturable in a CUDA graph)."""
    base = _hash32_int((seed ^ SEED_MIX) & MASK32)
    return hash32((step.detach().to(torch.int64) + base) & MASK32)


def noise16(key: Tensor, start: int, n: int) -> Tensor:
    """The 16-bit noise (int64, in [0, 65536)) of the ``n`` elements from flat index
    ``start`` under ``key`` (``step_key``)."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=key.device)
    return hash32((idx & MASK32) ^ key) & 0xFFFF


PIECE = 1 << 22
"""Elements ``stochastic_round_`` rounds at a time (bounds its int64 temporaries)."""


def stochastic_round_(x: Tensor, out: Tensor, key: Tensor, start: int) -> Tensor:
    """``out`` (bf16, flat) := the fp32 values ``x`` (flat, same length) rounded to bf16
    stochastically with the noise of flat indices ``start ..`` under ``key``. Returns ``out``.
    Works ``PIECE`` elements at a time (int64 temporaries of that size)."""
    flat, out16 = x.detach().reshape(-1), out.view(torch.int16)
    for a in range(0, flat.numel(), PIECE):
        piece = flat[a : a + PIECE]
        bits = piece.view(torch.int32).to(torch.int64) & MASK32
        bits = (bits + noise16(key, start + a, bits.numel())) >> 16
        bits = torch.where(torch.isnan(piece), 0x7FC0, bits & 0xFFFF)
        bits = bits - ((bits & 0x8000) << 1)  # as a signed 16-bit value
        out16[a : a + PIECE].copy_(bits)
    return out

"""bf16 + int16 "split" storage of fp32 values, bit for bit (integer ops only).

An fp32 value ``x`` is kept as ``hi`` (bf16: ``x`` rounded to nearest, ties away from zero)
and ``lo`` (int16: the rest), with ``bits(x) = (bits(hi) << 16) + lo`` on the int32 bit
patterns: exact for every finite value, +-0, subnormals and +-inf; a NaN becomes the
canonical NaN. ``MasterWeightAdamW(master_storage="split")`` keeps its fp32 masters this way
(2 bytes a parameter less), and longboat's AdamW kernels read and write the same layout.
"""

from __future__ import annotations

import sys

import torch

Tensor = torch.Tensor


def _check_little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is
        raise RuntimeError(
            "split master storage reads int16 halves of fp32 words: little-endian only"
        )


def split_bits_(bits: Tensor, hi: Tensor, lo: Tensor, nan: Tensor | None = None) -> None:
    """Split the fp32 values whose int32 bit patterns are ``bits`` into ``hi`` (bf16: the
    value rounded to nearest, ties away from zero) and ``lo`` (int16: the rest), in place.

    Destroys ``bits`` (it is left holding ``bits(hi)``). All flat, contiguous and of one
    length; ``nan`` an optional bool buffer of that length for the NaN mask (else allocated).
    Integer operations only, so the result does not depend on how a device converts floats.
    """
    _check_little_endian()
    x = bits.view(torch.float32)
    if nan is None:
        nan = torch.isnan(x)
    else:
        torch.ne(x, x, out=nan)
    lo.copy_(bits.view(torch.int16)[0::2])  # the low half, as a signed offset
    bits.sub_(lo)  # now bits(hi) << 16: the rounding, ties away from zero
    bits.bitwise_right_shift_(16)
    hi16 = hi.view(torch.int16)
    hi16.copy_(bits)
    # NaN: the canonical quiet NaN (a NaN with a high mantissa would round into the sign).
    hi16.masked_fill_(nan, 0x7FC0)
    lo.masked_fill_(nan, 0)


def join_bits_(bits: Tensor, hi: Tensor, lo: Tensor) -> Tensor:
    """``bits`` (int32) := the fp32 bit patterns ``(bits(hi) << 16) + lo``; returns ``bits``
    viewed as float32 (the exact master values)."""
    bits.copy_(lo)
    bits.add_(hi.view(torch.int16), alpha=1 << 16)
    return bits.view(torch.float32)


def split_fp32_(x: Tensor, hi: Tensor, lo: Tensor) -> None:
    """``hi`` (bf16), ``lo`` (int16) := the split storage of the fp32 values ``x`` (all flat
    and contiguous; ``x`` is not modified; allocates ``x``-sized temporaries)."""
    split_bits_(x.detach().reshape(-1).view(torch.int32).clone(), hi, lo)


def join_fp32_(hi: Tensor, lo: Tensor, out: Tensor | None = None) -> Tensor:
    """The fp32 values stored as ``hi`` (bf16) and ``lo`` (int16), bit for bit, into ``out``
    (fp32, flat, contiguous; allocated when None). Returns it."""
    if out is None:
        out = torch.empty(hi.shape, dtype=torch.float32, device=hi.device)
    return join_bits_(out.view(torch.int32), hi, lo)

"""Triton import shim: the package imports (references, attention) without Triton installed.

Triton is a Linux-only dependency. Where it is missing, ``triton.jit`` becomes a no-op
decorator so kernel modules still import; dispatch never picks the Triton path then.
"""

from __future__ import annotations

from typing import Any

try:  # pragma: no cover - exercised by the platform, not by tests
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

    class _Missing:
        """Stands in for ``triton`` / ``triton.language`` when Triton is not installed."""

        constexpr = Any

        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        def __getattr__(self, name: str) -> Any:
            raise ImportError(
                f"triton.{name} is needed for longboat's Triton kernels but Triton is not "
                "installed; install triton or call the kernels with impl='torch'"
            )

    triton = _Missing()  # type: ignore[assignment]
    tl = _Missing()  # type: ignore[assignment]


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())


__all__ = ["HAS_TRITON", "next_pow2", "tl", "triton"]

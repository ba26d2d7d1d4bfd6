"""Choosing between the pure-torch reference and the Triton kernel.

``impl`` argument > ``LONGBOAT_KERNELS_IMPL`` env > auto (Triton on CUDA tensors, torch
elsewhere). Forcing ``triton`` on CPU tensors works only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before ``triton`` is imported), which is how the CPU tests run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from longboat.kernels._triton import HAS_TRITON

Impl = Literal["auto", "torch", "triton"]
ENV_VAR = "LONGBOAT_KERNELS_IMPL"
_CHOICES = ("auto", "torch", "triton")


_META_STANDS_FOR: list[str] = []
"""Device types ``meta`` tensors stand for in dispatch (innermost last; see
``meta_stands_for``)."""


@contextmanager
def meta_stands_for(device_type: str) -> Iterator[None]:
    """Dispatch ops on ``meta`` tensors as on ``device_type`` tensors: with ``"cuda"``, every
    op picks its GPU implementation and runs that implementation's registered fake (shapes
    and dtypes only). A memory probe at real shapes (``longboat.core.engine.memory``) sees
    what the Triton kernels save for the backward, not what the torch references save."""
    _META_STANDS_FOR.append(device_type)
    try:
        yield
    finally:
        _META_STANDS_FOR.pop()


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda or (t.is_meta and bool(_META_STANDS_FOR) and _META_STANDS_FOR[-1] == "cuda")


def triton_interpreter_on() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def resolve_impl(
    impl: str | None, *tensors: torch.Tensor, compiled_reference_wins: bool = False
) -> str:
    """Return ``"torch"`` or ``"triton"`` for an op on ``tensors``.

    ``compiled_reference_wins``: the op's torch reference, compiled by Inductor, measured as
    fast as our kernel or faster (benchmarks/results/kernels_*.md); then ``auto`` hands the
    reference to torch.compile while it traces, so Inductor can also fuse it with its
    neighbours. Raises ValueError for an unknown name, and when ``triton`` is forced where
    it cannot run.
    """
    choice = impl if impl is not None else os.environ.get(ENV_VAR, "auto") or "auto"
    where = "impl argument" if impl is not None else f"{ENV_VAR} env"
    if choice not in _CHOICES:
        raise ValueError(
            f"{where}={choice!r} is not a kernel implementation; use one of {_CHOICES}"
        )
    if choice == "torch":
        return "torch"
    on_gpu = all(_on_gpu(t) for t in tensors)
    usable = HAS_TRITON and (on_gpu or triton_interpreter_on())
    if choice == "triton":
        if not usable:
            devices = sorted({str(t.device) for t in tensors})
            raise ValueError(
                f"{where}='triton' but the Triton kernels cannot run on {devices}"
                + ("" if HAS_TRITON else " (triton is not installed)")
                + ": pass CUDA tensors, set TRITON_INTERPRET=1 before importing triton for the "
                "CPU interpreter, or use impl='torch'"
            )
        return "triton"
    return auto_choice(
        on_gpu=on_gpu,
        triton_usable=usable,
        compiling=torch.compiler.is_compiling(),
        compiled_reference_wins=compiled_reference_wins,
    )


def auto_choice(
    *, on_gpu: bool, triton_usable: bool, compiling: bool, compiled_reference_wins: bool
) -> str:
    """The ``auto`` policy: Triton on GPU, except where compiled torch code measured faster."""
    if not (on_gpu and triton_usable):
        return "torch"
    if compiling and compiled_reference_wins:
        return "torch"
    return "triton"


def num_programs_for_reduction(rows: int, device: torch.device) -> int:
    """How many programs share a column reduction (weight gradients).

    On GPU ~4 per SM of an H100/H200 (132 SMs) keeps every SM busy while the fp32 partial
    sums stay ~1-2% of the traffic; the interpreter on CPU gets a handful.
    """
    return max(1, min(rows, 512 if device.type == "cuda" else 4))


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """View ``t`` as ``[rows, n]`` with a unit last stride (copies only when it must)."""
    t2 = t.reshape(-1, n)
    return t2 if n <= 1 or t2.stride(1) == 1 else t2.contiguous()


def op(name: str, eager_impl: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.ops.longboat.<name>`` while torch.compile traces, else the plain function.

    The custom-op dispatcher costs tens of microseconds of CPU per call, comparable to a
    whole memory-bound kernel at training shapes; eager mode skips it. Under
    torch.compile the registered op (with its fake impl) is what gets traced; under
    ``meta_stands_for`` meta tensors reach that fake.
    """
    if torch.compiler.is_compiling() or _META_STANDS_FOR:  # a meta probe runs the fakes
        return getattr(torch.ops.longboat, name)
    return eager_impl

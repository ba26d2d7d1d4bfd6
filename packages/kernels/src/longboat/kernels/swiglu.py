"""Gated linear units: SwiGLU (``silu(gate) * up``) and GeGLU (``gelu(gate) * up``).

Gate and up come as two tensors or as one packed tensor ``[..., 2 * inter]`` whose first
half is the gate (Megatron's fused ``linear_fc1`` layout). Forward reads gate and up once
and writes the product; backward recomputes the activation instead of saving it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longboat.kernels._dispatch import as_rows, op, resolve_impl
from longboat.kernels._triton import next_pow2, tl, triton

Tensor = torch.Tensor
_ACTS = ("silu", "gelu_tanh", "gelu")


def _split(gate: Tensor, up: Tensor | None) -> tuple[Tensor, Tensor]:
    if up is not None:
        return gate, up
    return gate.chunk(2, dim=-1)


def glu_torch(gate: Tensor, up: Tensor | None = None, activation: str = "silu") -> Tensor:
    """Pure-torch reference of :func:`glu` (math in fp32, output in the input dtype)."""
    g, u = _split(gate, up)
    gf = g.float()
    if activation == "silu":
        a = F.silu(gf)
    else:
        a = F.gelu(gf, approximate="tanh" if activation == "gelu_tanh" else "none")
    return (a * u.float()).to(g.dtype)


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """Activation of ``g`` (fp32) and its derivative."""
    if ACT == 0:  # silu
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) * (...)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (
            1.0 + 3.0 * 0.044715 * g * g
        )
    else:  # exact gelu
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    return a, da


@triton.jit
def _glu_fwd_kernel(
    G, U, Y, stride_g, stride_u, stride_y, n_cols,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(Y + row * stride_y + cols, (a * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, n_cols,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    tl.store(DG + row * stride_dg + cols, (dy * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, (dy * a).to(DU.dtype.element_ty), mask=mask)


def _launch_cfg(n: int) -> tuple[int, int]:
    block = min(next_pow2(n), 2048)
    return block, (4 if block <= 1024 else 8)


def _halves(x: Tensor) -> tuple[Tensor, Tensor]:
    n2 = x.shape[-1]
    x2 = x.contiguous().reshape(-1, n2)
    return x2[:, : n2 // 2], x2[:, n2 // 2 :]


def _glu_fwd_impl(gate: Tensor, up: Tensor | None, act: int) -> Tensor:
    if up is None:
        g2, u2 = _halves(gate)
        out_shape = (*gate.shape[:-1], gate.shape[-1] // 2)
    else:
        n = gate.shape[-1]
        g2, u2 = as_rows(gate, n), as_rows(up, n)
        out_shape = tuple(gate.shape)
    m, n = g2.shape
    y = torch.empty(m, n, device=gate.device, dtype=gate.dtype)
    block, warps = _launch_cfg(n)
    if m > 0 and n > 0:
        _glu_fwd_kernel[(m, triton.cdiv(n, block))](
            g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), n,
            ACT=act, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return y.view(out_shape)


_glu_fwd = torch.library.custom_op("longboat::glu_fwd", mutates_args=())(_glu_fwd_impl)


@_glu_fwd.register_fake
def _(gate: Tensor, up: Tensor | None, act: int):
    if up is None:
        return gate.new_empty((*gate.shape[:-1], gate.shape[-1] // 2))
    return gate.new_empty(gate.shape)


def _glu_bwd_impl(dy: Tensor, gate: Tensor, up: Tensor | None, act: int) -> tuple[Tensor, Tensor]:
    n = dy.shape[-1]
    dy2 = as_rows(dy, n)
    m = dy2.shape[0]
    if up is None:
        g2, u2 = _halves(gate)
        dgu = torch.empty(m, 2 * n, device=gate.device, dtype=gate.dtype)
        dg, du = dgu[:, :n], dgu[:, n:]
    else:
        g2, u2 = as_rows(gate, n), as_rows(up, n)
        dg, du = g2.new_empty(g2.shape), u2.new_empty(u2.shape)
    block, warps = _launch_cfg(n)
    if m > 0 and n > 0:
        _glu_bwd_kernel[(m, triton.cdiv(n, block))](
            dy2, g2, u2, dg, du,
            dy2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0), du.stride(0), n,
            ACT=act, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    if up is None:
        return dgu.view(gate.shape), gate.new_empty(0)
    return dg.view(gate.shape), du.view(up.shape)


_glu_bwd = torch.library.custom_op("longboat::glu_bwd", mutates_args=())(_glu_bwd_impl)


@_glu_bwd.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor | None, act: int):
    if up is None:
        return gate.new_empty(gate.shape), gate.new_empty(0)
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


class _GLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return op("glu_fwd", _glu_fwd_impl)(gate, up, act)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        dg, du = op("glu_bwd", _glu_bwd_impl)(dy, gate, up, ctx.act)
        return dg, (du if up is not None else None), None


def glu_triton(gate: Tensor, up: Tensor | None = None, activation: str = "silu") -> Tensor:
    """Triton gated linear unit (fwd + bwd), same signature as :func:`glu_torch`."""
    return _GLUFn.apply(gate, up, _ACTS.index(activation))


def glu(
    gate: Tensor,
    up: Tensor | None = None,
    activation: str = "silu",
    *,
    impl: str | None = None,
) -> Tensor:
    """``act(gate) * up``; with ``up=None``, ``gate`` is packed ``[..., 2 * inter]`` (gate first).

    ``activation``: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` or ``"gelu"`` (GeGLU).
    """
    if activation not in _ACTS:
        raise ValueError(f"glu: activation={activation!r} is not one of {_ACTS}")
    if up is None and gate.shape[-1] % 2:
        raise ValueError(
            f"glu: packed gate/up input needs an even last dim, got {gate.shape[-1]}; "
            "pass gate and up separately"
        )
    if up is not None and (up.shape != gate.shape or up.dtype != gate.dtype):
        raise ValueError(
            f"glu: up {tuple(up.shape)}/{up.dtype} must match gate {tuple(gate.shape)}/{gate.dtype}"
        )
    # Inductor reaches the same share of copy bandwidth (benchmarks/notes/kernels.md).
    if resolve_impl(impl, gate, compiled_reference_wins=True) == "torch":
        return glu_torch(gate, up, activation)
    return glu_triton(gate, up, activation)


def swiglu(gate: Tensor, up: Tensor | None = None, *, impl: str | None = None) -> Tensor:
    """SwiGLU: ``silu(gate) * up`` (see :func:`glu` for the packed layout)."""
    return glu(gate, up, "silu", impl=impl)


def geglu(
    gate: Tensor, up: Tensor | None = None, *, approximate: str = "tanh", impl: str | None = None
) -> Tensor:
    """GeGLU: ``gelu(gate) * up``; ``approximate="tanh"`` (Gemma, PaliGemma) or ``"none"``."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"geglu: approximate={approximate!r} must be 'tanh' or 'none'")
    return glu(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu", impl=impl)

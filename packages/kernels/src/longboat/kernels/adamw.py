"""AdamW on fp32 master weights from low-precision grads, in one pass: torch reference,
Triton kernel, dispatch.

``adamw_master_step_(master, grad, exp_avg, exp_avg_sq, param_out, ...)`` updates flat 1-D
buffers in place, as ``torch.optim.AdamW`` would update fp32 weights ``master`` with the
grads ``grad.float() / grad_scale``, and writes ``master`` rounded to ``param_out``'s dtype
(the bf16 weights the model computes with). Per element the kernel reads the grad (2 bytes
in bf16), the master weight and both moments (12) and writes them back (12) plus the bf16
weight (2): 28 bytes, where casting the grads into an fp32 buffer, ``torch._fused_adamw_``
and a master -> bf16 copy move ~44.

Capturable in a CUDA graph: ``lr``, ``step``, ``grad_scale`` and ``found_inf`` are device
tensors read by the kernel (no host read, and no per-step Python number among the kernel's
arguments). A nonzero ``found_inf`` turns every load and store off: nothing changes.
Offsets are int64, so one call covers a buffer of more than 2**31 elements.

Numerics: element-wise math in fp32 with IEEE division and square root; the bias
corrections ``1 - beta ** step`` in fp64 (as torch does: in fp32, ``1 - 0.999`` alone is off
by 1e-5 relative).

Split master storage (``master_lo=``): the fp32 master is not stored; it is the bf16 weight
``hi`` (``master`` then is the bf16 weight buffer, updated in place) plus an int16 buffer
``lo``, with ``bits(x) = (bits(hi) << 16) + lo`` in int32 arithmetic on the bit patterns:
exact, for every finite value, +-0, subnormals and +-inf. ``hi`` is ``x`` rounded to bf16 to
nearest with ties away from zero (not torch's ties to even: at an exact tie that would leave
``lo = +32768``, which int16 cannot hold), so the masters, and so the whole update, are bit
for bit those of fp32 storage; the bf16 weight differs from torch's fp32 -> bf16 cast only
at exact ties (low 16 bits ``0x8000``), by one bf16 ulp. A NaN master becomes the canonical
NaN (``hi = 0x7FC0``, ``lo = 0``: its payload is lost, it stays NaN). Per element the split
kernel reads grad, hi, lo and both moments (14 bytes) and writes hi, lo and the moments
(12): 26 bytes, and the optimizer keeps 2 bytes a parameter less (no fp32 master buffer).
``split_fp32_`` / ``join_fp32_`` convert between the two storages.

bf16 moments: ``exp_avg`` / ``exp_avg_sq`` may be bf16 (4 bytes a parameter less); they
are read to fp32, updated in fp32 and stored rounded to nearest even, as torch's
fp32 -> bf16 copy rounds. Changes numerics (the moments lose 16 mantissa bits a step).

Stochastic rounding (``sr_key=``): no masters at all; ``master`` is the bf16 weight buffer,
the update runs in fp32 from it and the result is rounded back to bf16 stochastically with
counter-based noise from (seed, step, flat index) (``longboat.core.engine.torch.
stochastic_round``, computed alike here and in the torch reference). Per element the kernel
reads grad, weight and both moments and writes weight and moments: 10 + 10 bytes with bf16
moments. Changes numerics (the weight carries no bits below bf16; unbiased on average).
"""

from __future__ import annotations

import torch

# The split storage's bit ops are core's (the master-weight optimizer uses them too);
# re-exported here for the kernels' callers.
from longboat.core.engine.torch.bf16_split import (  # noqa: F401
    join_bits_,
    join_fp32_,
    split_bits_,
    split_fp32_,
)
from longboat.core.engine.torch.stochastic_round import (  # noqa: F401
    step_key,
    stochastic_round_,
)
from longboat.kernels._dispatch import op, resolve_impl
from longboat.kernels._triton import tl, triton

Tensor = torch.Tensor

BLOCK = 1024
"""Elements per Triton program (8 per thread at 4 warps: 16-byte loads of the fp32 buffers)."""


def _bias_correction_powers(step: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    """``beta1 ** step`` and ``beta2 ** step`` as fp64 device tensors (no host read)."""
    s = step.to(torch.float64)
    return torch.pow(beta1, s), torch.pow(beta2, s)


def adamw_master_step_torch_(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    param_out: Tensor | None,
    *,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Tensor,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    master_lo: Tensor | None = None,
    sr_key: Tensor | None = None,
    sr_start: int = 0,
) -> None:
    """Pure-torch reference of :func:`adamw_master_step_` (same contract, same fp32 math;
    allocates full-size temporaries, so it is for checks and small buffers)."""
    if sr_key is not None:
        weight = master
        master = weight.float()
        adamw_master_step_torch_(
            master, grad, exp_avg, exp_avg_sq, None, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, step=step, grad_scale=grad_scale, found_inf=found_inf,
        )  # fmt: skip
        rounded = stochastic_round_(master, torch.empty_like(weight), sr_key, sr_start)
        if found_inf is not None:
            rounded = torch.where(found_inf != 0, weight, rounded)
        weight.copy_(rounded)
        return
    if master_lo is not None:
        adamw_split_master_step_torch_(
            master, master_lo, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, step=step, grad_scale=grad_scale,
            found_inf=found_inf,
        )  # fmt: skip
        return
    pow1, pow2 = _bias_correction_powers(step, beta1, beta2)
    step_size = (lr.to(torch.float64) / (1.0 - pow1)).float()
    bc2_sqrt = (1.0 - pow2).sqrt().float()
    lr32 = lr.float()
    g = grad.float()
    if grad_scale is not None:
        g = g / grad_scale.float()
    p = master * (1.0 - lr32 * weight_decay)
    m = exp_avg.float() * beta1 + g * (1.0 - beta1)
    v = exp_avg_sq.float() * beta2 + g * g * (1.0 - beta2)
    p = p - step_size * m / (v.sqrt() / bc2_sqrt + eps)
    if found_inf is None:
        new = (p, m, v)
    else:
        skip = found_inf != 0
        new = tuple(
            torch.where(skip, old.float(), t)
            for old, t in zip((master, exp_avg, exp_avg_sq), (p, m, v))
        )
    for buf, value in zip((master, exp_avg, exp_avg_sq), new):
        buf.copy_(value)  # bf16 moments: rounded to nearest even, as the kernel stores them
    if param_out is not None:
        rounded = master.to(param_out.dtype)
        if found_inf is not None:
            rounded = torch.where(found_inf != 0, param_out, rounded)
        param_out.copy_(rounded)


def adamw_split_master_step_torch_(
    hi: Tensor,
    lo: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Tensor,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """Pure-torch reference of :func:`adamw_master_step_` with split storage: join the
    masters, the fp32 reference update, split them back (a skipped step rewrites the same
    bits). Allocates full-size temporaries: for checks and small buffers."""
    master = join_fp32_(hi, lo)
    adamw_master_step_torch_(
        master, grad, exp_avg, exp_avg_sq, None, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, step=step, grad_scale=grad_scale, found_inf=found_inf,
    )  # fmt: skip
    split_bits_(master.view(torch.int32), hi, lo)


@triton.jit
def _round_to_bf16(x):
    # Round to nearest even on the bits, as torch's fp32 -> bf16 copy does. The GPU's own
    # conversion does the same, but Triton's CPU interpreter truncates; on the bits both
    # agree, so the interpreter checks what the GPU runs. NaN stays a quiet NaN.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    bits = tl.where(x != x, 0x7FC00000, bits)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _hash32(x):
    # stochastic_round.hash32 in int64 arithmetic (values in [0, 2**32); the multipliers are
    # below 2**31, so the products are exact before the mask).
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _store_fp32_or_bf16(PTR, offs, x, mask):
    if PTR.dtype.element_ty == tl.bfloat16:
        tl.store(PTR + offs, _round_to_bf16(x), mask=mask)
    else:
        tl.store(PTR + offs, x, mask=mask)


@triton.jit
def _adamw_master_kernel(
    P, LO, G, M, V, OUT, LR, STEP_POW1, STEP_POW2, SCALE, FOUND_INF, KEY,
    N, SR_START, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
    SPLIT: tl.constexpr, SR: tl.constexpr, HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_INF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # SPLIT: P holds the int16 bits of the bf16 weights (the masters' high halves) and LO
    # their int16 low halves; the master is (hi << 16) + lo on the int32 bit patterns.
    # SR: P holds the int16 bits of the bf16 weights, the only copy: the update starts from
    # them and rounds back stochastically with the noise of (KEY, SR_START + offs).
    # M and V: fp32, or bf16 (loaded to fp32, stored rounded to nearest even).
    # int64 before the multiply: buffers of more than 2**31 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    limit = N
    if HAS_INF:
        # A skipped step masks every load and store (no traffic, nothing written).
        limit = tl.where(tl.load(FOUND_INF).to(tl.float32) == 0.0, N, 0)
    mask = offs < limit
    lr = tl.load(LR).to(tl.float32)
    # Scalars in fp64, as torch does: 1 - beta2 ** step loses ~1e-5 relative in fp32.
    bc1 = 1.0 - tl.load(STEP_POW1)
    bc2_sqrt = tl.sqrt(1.0 - tl.load(STEP_POW2)).to(tl.float32)
    step_size = (lr.to(tl.float64) / bc1).to(tl.float32)

    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = tl.math.div_rn(g, tl.load(SCALE).to(tl.float32))
    if SPLIT:
        hi = tl.load(P + offs, mask=mask, other=0).to(tl.int32)
        lo = tl.load(LO + offs, mask=mask, other=0).to(tl.int32)
        p = ((hi << 16) + lo).to(tl.float32, bitcast=True)
    elif SR:
        hi = tl.load(P + offs, mask=mask, other=0).to(tl.int32)
        p = (hi << 16).to(tl.float32, bitcast=True)
    else:
        p = tl.load(P + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * (1.0 - lr * weight_decay)
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + g * g * one_minus_beta2
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.math.div_rn(step_size * m, denom)
    if SPLIT:
        # lo: the low 16 bits as a signed offset; hi: the rest, i.e. the value rounded to
        # bf16 to nearest, ties away from zero. NaN: the canonical quiet NaN, lo = 0.
        bits = p.to(tl.int32, bitcast=True)
        lo = ((bits & 0xFFFF) ^ 0x8000) - 0x8000
        hi = (bits - lo) >> 16
        nan = p != p
        hi = tl.where(nan, 0x7FC0, hi)
        lo = tl.where(nan, 0, lo)
        tl.store(P + offs, hi.to(tl.int16), mask=mask)
        tl.store(LO + offs, lo.to(tl.int16), mask=mask)
    elif SR:
        key = tl.load(KEY)
        noise = _hash32(((SR_START + offs) & 0xFFFFFFFF) ^ key) & 0xFFFF
        bits = p.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        hi = ((bits + noise) >> 16) & 0xFFFF
        hi = tl.where(p != p, 0x7FC0, hi)
        tl.store(P + offs, (hi - ((hi & 0x8000) << 1)).to(tl.int16), mask=mask)
    else:
        tl.store(P + offs, p, mask=mask)
    _store_fp32_or_bf16(M, offs, m, mask)
    _store_fp32_or_bf16(V, offs, v, mask)
    if HAS_OUT:
        if OUT.dtype.element_ty == tl.bfloat16:
            out = _round_to_bf16(p)
        else:
            out = p.to(OUT.dtype.element_ty)
        tl.store(OUT + offs, out, mask=mask)


def _launch_adamw_master_kernel(
    p: Tensor,
    lo: Tensor | None,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    out: Tensor | None,
    lr: Tensor,
    step: Tensor,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    sr_key: Tensor | None = None,
    sr_start: int = 0,
) -> None:
    """One launch of ``_adamw_master_kernel`` over ``p``: fp32 masters when ``lo`` and
    ``sr_key`` are None, else split storage (``p`` the int16 view of the bf16 weights, ``lo``
    their low halves) or stochastically rounded bf16 weights (``p`` their int16 view);
    ``out`` (optional) gets the updated master rounded to its dtype."""
    n = p.numel()
    if n == 0:
        return
    pow1, pow2 = _bias_correction_powers(step, beta1, beta2)
    _adamw_master_kernel[(triton.cdiv(n, BLOCK),)](
        p,
        lo if lo is not None else p,  # unused (SPLIT=False)
        grad, exp_avg, exp_avg_sq,
        out if out is not None else p,  # unused (HAS_OUT=False)
        lr, pow1, pow2,
        grad_scale if grad_scale is not None else lr,  # unused (HAS_SCALE=False)
        found_inf if found_inf is not None else lr,  # unused (HAS_INF=False)
        sr_key if sr_key is not None else lr,  # unused (SR=False)
        n, sr_start, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, weight_decay,
        SPLIT=lo is not None, SR=sr_key is not None, HAS_OUT=out is not None, HAS_SCALE=grad_scale is not None,
        HAS_INF=found_inf is not None, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip


# The two custom ops' bodies: their signatures are the ops' schemas (names included, for
# mutates_args), so each keeps its own; the launch is shared.
def _adamw_master_step_impl(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    param_out: Tensor | None,
    lr: Tensor,
    step: Tensor,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    _launch_adamw_master_kernel(
        master, None, grad, exp_avg, exp_avg_sq, param_out, lr, step, grad_scale, found_inf,
        beta1, beta2, eps, weight_decay,
    )  # fmt: skip


def _adamw_split_master_step_impl(
    hi: Tensor,
    lo: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    lr: Tensor,
    step: Tensor,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    # No param_out: hi is the bf16 weight.
    _launch_adamw_master_kernel(
        hi.view(torch.int16), lo, grad, exp_avg, exp_avg_sq, None, lr, step, grad_scale,
        found_inf, beta1, beta2, eps, weight_decay,
    )  # fmt: skip


def _adamw_sr_step_impl(
    weight: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    lr: Tensor,
    step: Tensor,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    sr_key: Tensor,
    sr_start: int,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    # No param_out: the bf16 weight is the only copy.
    _launch_adamw_master_kernel(
        weight.view(torch.int16), None, grad, exp_avg, exp_avg_sq, None, lr, step, grad_scale,
        found_inf, beta1, beta2, eps, weight_decay, sr_key=sr_key, sr_start=sr_start,
    )  # fmt: skip


def _in_place_only_fake(*args: object) -> None:
    """Fake impl of both ops: they only write their arguments in place (no outputs)."""
    return None


_adamw_master_step = torch.library.custom_op(
    "longboat::adamw_master_step", mutates_args=("master", "exp_avg", "exp_avg_sq", "param_out")
)(_adamw_master_step_impl)
_adamw_master_step.register_fake(_in_place_only_fake)

_adamw_split_master_step = torch.library.custom_op(
    "longboat::adamw_split_master_step", mutates_args=("hi", "lo", "exp_avg", "exp_avg_sq")
)(_adamw_split_master_step_impl)
_adamw_split_master_step.register_fake(_in_place_only_fake)

_adamw_sr_step = torch.library.custom_op(
    "longboat::adamw_sr_step", mutates_args=("weight", "exp_avg", "exp_avg_sq")
)(_adamw_sr_step_impl)
_adamw_sr_step.register_fake(_in_place_only_fake)


def adamw_master_step_triton_(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    param_out: Tensor | None,
    *,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Tensor,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    master_lo: Tensor | None = None,
    sr_key: Tensor | None = None,
    sr_start: int = 0,
) -> None:
    """Triton :func:`adamw_master_step_` (one launch plus two scalar fp64 ``pow``)."""
    scalars = (float(beta1), float(beta2), float(eps), float(weight_decay))
    if sr_key is not None:
        op("adamw_sr_step", _adamw_sr_step_impl)(
            master, grad, exp_avg, exp_avg_sq, lr, step, grad_scale, found_inf, sr_key,
            int(sr_start), *scalars,
        )  # fmt: skip
        return
    if master_lo is not None:
        op("adamw_split_master_step", _adamw_split_master_step_impl)(
            master, master_lo, grad, exp_avg, exp_avg_sq, lr, step, grad_scale, found_inf,
            *scalars,
        )  # fmt: skip
        return
    op("adamw_master_step", _adamw_master_step_impl)(
        master, grad, exp_avg, exp_avg_sq, param_out, lr, step, grad_scale, found_inf, *scalars
    )


def _check(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    param_out: Tensor | None,
    scalars: dict[str, Tensor | None],
    master_lo: Tensor | None = None,
    sr_key: Tensor | None = None,
) -> None:
    buffers = {"master": master, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if param_out is not None:
        buffers["param_out"] = param_out
    if master_lo is not None:
        buffers["master_lo"] = master_lo
        if master.dtype != torch.bfloat16 or master_lo.dtype != torch.int16:
            raise ValueError(
                "adamw_master_step_: split storage (master_lo given) needs master = the bf16 "
                f"weights and master_lo int16, got {master.dtype} and {master_lo.dtype}; pass "
                "an fp32 master without master_lo otherwise"
            )
        if param_out is not None:
            raise ValueError(
                "adamw_master_step_: with master_lo (split storage) master is the bf16 weight "
                "buffer itself; pass param_out=None"
            )
    if sr_key is not None:
        if master_lo is not None or param_out is not None or master.dtype != torch.bfloat16:
            raise ValueError(
                "adamw_master_step_: stochastic rounding (sr_key given) updates the bf16 "
                f"weights in place: pass master = the bf16 weights (got {master.dtype}), "
                "master_lo=None and param_out=None"
            )
        if sr_key.dtype != torch.int64 or sr_key.numel() != 1 or sr_key.device != master.device:
            raise ValueError(
                "adamw_master_step_: sr_key must be a one-element int64 tensor on "
                f"{master.device} (stochastic_round.step_key), got {sr_key!r}"
            )
    for name, t in buffers.items():
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != master.numel():
            raise ValueError(
                f"adamw_master_step_: {name} must be a contiguous 1-D tensor of master's "
                f"{master.numel()} elements, got shape {tuple(t.shape)} "
                f"(contiguous={t.is_contiguous()}); pass flat buffers"
            )
        if t.device != master.device:
            raise ValueError(
                f"adamw_master_step_: {name} is on {t.device}, master on {master.device}"
            )
    if master_lo is None and sr_key is None and master.dtype != torch.float32:
        raise ValueError(f"adamw_master_step_: master must be float32, got {master.dtype}")
    for name in ("exp_avg", "exp_avg_sq"):
        if buffers[name].dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"adamw_master_step_: {name} must be float32 or bfloat16, got {buffers[name].dtype}"
            )
    low = (torch.float32, torch.bfloat16, torch.float16)
    if grad.dtype not in low or (param_out is not None and param_out.dtype not in low):
        raise ValueError(
            "adamw_master_step_: grad and param_out must be float32, bfloat16 or float16, got "
            f"{grad.dtype} and {None if param_out is None else param_out.dtype}"
        )
    for name, t in scalars.items():
        if t is None:
            continue
        if not isinstance(t, Tensor) or t.numel() != 1 or t.device != master.device:
            raise ValueError(
                f"adamw_master_step_: {name} must be a one-element tensor on {master.device} "
                f"(a Python number would be frozen into a captured CUDA graph), got {t!r}"
            )


def adamw_master_step_(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    param_out: Tensor | None,
    *,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Tensor,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    master_lo: Tensor | None = None,
    sr_key: Tensor | None = None,
    sr_start: int = 0,
    impl: str | None = None,
) -> None:
    """One AdamW step on fp32 ``master`` and moments, in place, from ``grad``; writes the
    updated master rounded to ``param_out`` (skipped when it is None).

    ``master_lo`` (int16): split storage (module doc). ``master`` is then the bf16 weight
    buffer, the masters' high halves, and ``master_lo`` their low halves; both are updated
    in place (the same master values as fp32 storage, bit for bit) and ``param_out`` must be
    None.

    ``sr_key`` (int64 0-d, ``stochastic_round.step_key(seed, step)``): bf16 weights without
    masters. ``master`` is then the bf16 weight buffer, the only copy: the update runs in
    fp32 from it and rounds back stochastically with the noise of flat indices
    ``sr_start ..`` (``stochastic_round``); ``param_out`` must be None.

    ``exp_avg`` / ``exp_avg_sq``: fp32, or bf16 (read to fp32, updated in fp32, stored
    rounded to nearest even).

    All buffers are flat, contiguous and of one length; ``master``, ``exp_avg`` and
    ``exp_avg_sq`` fp32, ``grad`` and ``param_out`` bf16, fp16 or fp32. ``lr``, ``step``
    (already counting this step, as torch's state ``step`` after its increment),
    ``grad_scale`` (grads are divided by it: clipping) and ``found_inf`` (nonzero: skip, every
    buffer unchanged) are one-element device tensors. Decoupled weight decay
    ``master *= 1 - lr * weight_decay``, as ``torch.optim.AdamW``.

    ``impl``: ``"torch"``, ``"triton"`` or ``"auto"`` (default: ``LONGBOAT_KERNELS_IMPL`` env,
    else Triton on CUDA tensors and the torch reference elsewhere).
    """
    scalars = {"lr": lr, "step": step, "grad_scale": grad_scale, "found_inf": found_inf}
    _check(master, grad, exp_avg, exp_avg_sq, param_out, scalars, master_lo, sr_key)
    kwargs = {
        "master_lo": master_lo,
        "sr_key": sr_key,
        "sr_start": sr_start,
        "lr": lr,
        "beta1": beta1,
        "beta2": beta2,
        "eps": eps,
        "weight_decay": weight_decay,
        "step": step,
        "grad_scale": grad_scale,
        "found_inf": found_inf,
    }
    if resolve_impl(impl, master) == "torch":
        adamw_master_step_torch_(master, grad, exp_avg, exp_avg_sq, param_out, **kwargs)
    else:
        adamw_master_step_triton_(master, grad, exp_avg, exp_avg_sq, param_out, **kwargs)

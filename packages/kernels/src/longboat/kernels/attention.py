"""Attention dispatch: one call, several backends.

``attention(q, k, v, *, causal, cu_seqlens=None, max_seqlen=None, scale=None, mask=None,
backend=None)``

Layout: ``q`` is ``[batch, seq_q, heads_q, head_dim]``, ``k``/``v`` are
``[batch, seq_kv, heads_kv, head_dim]`` with ``heads_q % heads_kv == 0`` (GQA/MQA). With
``cu_seqlens`` (``[docs + 1]`` int32 offsets, flash-attn's varlen convention) the inputs are
packed ``[total_tokens, heads, head_dim]`` (or the same with a leading batch of 1) and tokens
attend only inside their own document. ``mask``: a bool tensor broadcastable to
``[batch, heads, seq_q, seq_kv]`` (``True`` = may attend), combined with ``causal``; or a
FlexAttention ``BlockMask``. ``causal`` is top-left aligned (query i sees keys <= i), as
torch SDPA. Output has ``q``'s layout.

Backends: ``sdpa`` (torch picks flash / cuDNN / memory-efficient / math), ``sdpa_flash``,
``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_math`` (pinned through
``torch.nn.attention.sdpa_kernel``), ``flash_attn`` and ``te`` (imported lazily, only when
installed), ``varlen`` (torch's own flash varlen kernel,
``torch.nn.attention.varlen.varlen_attn``, CUDA only, packed documents only), ``flex``
(FlexAttention; compiled on GPU) and ``eager`` (explicit softmax, the reference). ``backend=None`` reads ``LONGBOAT_ATTENTION_BACKEND``, else picks by inputs and
availability (see :func:`select_backend`).
"""

from __future__ import annotations

import functools
import importlib
import math
import os
from typing import Any

import torch
import torch.nn.functional as F

from longboat.kernels import attention_masks as masks

Tensor = torch.Tensor
ENV_VAR = "LONGBOAT_ATTENTION_BACKEND"
_SDPA = {
    "sdpa": None,
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}
BACKENDS = (*_SDPA, "flash_attn", "te", "varlen", "flex", "eager")
_EXTRA = {"flash_attn": "longboat-kernels[flash-attn]", "te": "longboat-kernels[te]"}


class AttentionBackendUnavailableError(RuntimeError):
    """A forced attention backend is not installed or cannot run these inputs."""


@functools.cache
def _import_optional(name: str) -> Any | None:
    # importlib keeps these out of the static import graph: kernels must not depend on
    # transformer_engine (import-linter contract); both are optional extras.
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, or a broken CUDA extension build
        return None


def backend_available(name: str) -> bool:
    """Whether ``name`` can run in this environment (installed; flex needs torch >= 2.5)."""
    if name == "flash_attn":
        return _import_optional("flash_attn") is not None
    if name == "te":
        return _import_optional("transformer_engine.pytorch") is not None
    if name == "flex":
        return _import_optional("torch.nn.attention.flex_attention") is not None
    if name == "varlen":
        return _varlen_fn() is not None
    return name in BACKENDS


def available_backends() -> list[str]:
    """The backends :func:`attention` can use here."""
    return [b for b in BACKENDS if backend_available(b)]


def _is_block_mask(mask: Any) -> bool:
    return mask is not None and type(mask).__name__ == "BlockMask"


def select_backend(
    q: Tensor, *, cu_seqlens: Tensor | None = None, mask: Any = None, backend: str | None = None
) -> str:
    """Resolve ``backend`` (argument > env > auto) and check that it can run.

    Auto: a ``BlockMask`` -> flex; CPU -> sdpa; packed fp16 / bf16 documents on GPU ->
    flash_attn, else te, else torch's varlen kernel, else flex; packed fp32 documents on GPU
    -> sdpa; everything else -> sdpa (cuDNN / flash inside torch).
    """
    name = backend or os.environ.get(ENV_VAR) or "auto"
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"attention: backend={name!r} is unknown; use one of {BACKENDS}")
        if not backend_available(name):
            pkg = {"flash_attn": "flash-attn", "te": "transformer-engine"}.get(name, name)
            raise AttentionBackendUnavailableError(
                f"attention backend {name!r} is not available: {pkg} is not installed. "
                f"Install it with `pip install {_EXTRA.get(name, 'torch>=2.5')}`, or pick one "
                f"of the available backends {available_backends()}"
            )
        return name
    if _is_block_mask(mask):
        return "flex"
    return auto_backend(q.is_cuda, q.dtype, packed=cu_seqlens is not None and mask is None)


FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes the flash kernels (flash-attn, TE, torch's varlen) take."""


def auto_backend(cuda: bool, dtype: torch.dtype, *, packed: bool) -> str:
    """The automatic choice for inputs on CUDA (or not) of ``dtype``, packed documents (or
    not): packed half-precision documents on GPU go to a flash varlen kernel, packed fp32
    ones to sdpa with the documents' mask, as on CPU (the flash kernels take only fp16 /
    bf16, and inductor has no fp32 flex kernel for every head size)."""
    if not cuda:
        return "sdpa"
    if packed:
        if dtype not in FLASH_DTYPES:
            return "sdpa"
        for cand in ("flash_attn", "te", "varlen"):
            if backend_available(cand):
                return cand
        return "flex"
    return "sdpa"


# --------------------------------------------------------------------------- helpers


def _to_bhsd(x: Tensor) -> Tensor:
    return x.transpose(1, 2)


def _combined_mask(
    mask: Tensor | None, causal: bool, q_len: int, kv_len: int, device: torch.device
) -> Tensor | None:
    if causal:
        tri = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril()
        mask = tri if mask is None else (mask.to(torch.bool) & tri)
    return mask


def _varlen_inputs(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, mask: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Packed ``[T, H, D]`` -> batch-1 ``[1, T, H, D]`` plus the dense document mask."""
    if mask is not None and not _is_block_mask(mask):
        raise ValueError("attention: pass either cu_seqlens or a dense mask, not both")
    q4, k4, v4 = (t.unsqueeze(0) if t.dim() == 3 else t for t in (q, k, v))
    if q4.shape[0] != 1:
        raise ValueError(
            f"attention: with cu_seqlens q must be packed [tokens, heads, dim] (or batch 1), "
            f"got {tuple(q.shape)}"
        )
    return q4, k4, v4, masks.document_mask(cu_seqlens, total=q4.shape[1])


# --------------------------------------------------------------------------- backends


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Reference: explicit fp32 softmax(q k^T * scale + mask) v on ``[B, S, H, D]`` inputs."""
    hq, hk = q.shape[2], k.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf = (_to_bhsd(t).float() for t in (q, k, v))
    if hq != hk:
        kf = kf.repeat_interleave(hq // hk, dim=1)
        vf = vf.repeat_interleave(hq // hk, dim=1)
    scores = qf @ kf.transpose(-1, -2) * scale
    full = _combined_mask(mask, causal, q.shape[1], k.shape[1], q.device)
    if full is not None:
        scores = scores.masked_fill(~full, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
    return _to_bhsd(probs @ vf).to(q.dtype)


def _sdpa(q, k, v, causal, mask, scale, which):  # type: ignore[no-untyped-def]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if mask is not None:
        attn_mask, is_causal = _combined_mask(mask, causal, q.shape[1], k.shape[1], q.device), False
    else:
        attn_mask, is_causal = None, causal
    gqa = q.shape[2] != k.shape[2]
    if gqa and which in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        # enable_gqa is honoured by flash and math only; expand K/V for the others.
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        gqa = False
    args = (_to_bhsd(q), _to_bhsd(k), _to_bhsd(v))
    kwargs = dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    if which is None:
        out = F.scaled_dot_product_attention(*args, **kwargs)
    else:
        with sdpa_kernel([getattr(SDPBackend, which)]):
            out = F.scaled_dot_product_attention(*args, **kwargs)
    return _to_bhsd(out)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, causal, mask, scale, cu_seqlens):  # type: ignore[no-untyped-def]
    from torch.nn.attention.flex_attention import flex_attention

    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if _is_block_mask(mask):
        block_mask = mask
        if causal:
            raise ValueError("attention: with a BlockMask, put causality into its mask_mod")
    elif cu_seqlens is not None:
        block_mask = masks.document_block_mask(cu_seqlens, causal=causal, total=sq)
    elif mask is not None:
        full = _combined_mask(mask, causal, sq, sk, q.device)
        block_mask = masks.block_mask_from_dense(full.expand(b, *full.shape[-3:]))
    elif causal:
        block_mask = masks._create_block_mask(lambda b, h, i, j: i >= j, None, sq, sk, q.device)
    else:
        block_mask = None
    fn = _compiled_flex() if q.is_cuda else flex_attention
    out = fn(
        _to_bhsd(q), _to_bhsd(k), _to_bhsd(v),
        block_mask=block_mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )  # fmt: skip
    return _to_bhsd(out)


@functools.cache
def _varlen_fn() -> Any | None:
    """torch's ``varlen_attn`` (torch >= 2.9), or None."""
    mod = _import_optional("torch.nn.attention.varlen")
    return getattr(mod, "varlen_attn", None)


@functools.cache
def _varlen_causal_kwargs(causal: bool) -> dict[str, Any]:
    """How this torch's ``varlen_attn`` asks for causality: ``is_causal`` (2.9, 2.10) or a
    ``window_size`` of ``(-1, 0)`` (2.11 on)."""
    import inspect

    params = inspect.signature(_varlen_fn()).parameters
    if "is_causal" in params:
        return {"is_causal": causal}
    return {"window_size": (-1, 0) if causal else (-1, -1)}


def _varlen(q, k, v, causal, scale, cu_seqlens, max_seqlen):  # type: ignore[no-untyped-def]
    if cu_seqlens is None or not q.is_cuda:
        raise ValueError("attention backend 'varlen' needs cu_seqlens and CUDA tensors")
    q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    if k3.shape[1] != q3.shape[1]:  # grouped KV heads: this kernel wants them expanded
        rep = q3.shape[1] // k3.shape[1]
        k3, v3 = k3.repeat_interleave(rep, dim=1), v3.repeat_interleave(rep, dim=1)
    cu = cu_seqlens.to(device=q3.device, dtype=torch.int32)
    # An upper bound is valid and reads nothing back from the device (no sync per call).
    max_len = max_seqlen or q3.shape[0]
    out = _varlen_fn()(
        q3, k3, v3, cu, cu, max_len, max_len, scale=scale, **_varlen_causal_kwargs(causal)
    )
    return out.reshape(q.shape)


def _flash_attn(q, k, v, causal, scale, cu_seqlens, max_seqlen):  # type: ignore[no-untyped-def]
    fa = _import_optional("flash_attn")
    if cu_seqlens is not None:
        q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
        cu = cu_seqlens.to(torch.int32)
        max_len = max_seqlen or q3.shape[0]  # an upper bound: no device sync
        out = fa.flash_attn_varlen_func(
            q3, k3, v3, cu, cu, max_len, max_len, softmax_scale=scale, causal=causal
        )
        return out.view(q.shape)
    return fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)


@functools.cache
def _te_module(heads: int, kv_heads: int, dim: int, mask_type: str, fmt: str, scale: float):  # type: ignore[no-untyped-def]
    te = _import_optional("transformer_engine.pytorch")
    return te.DotProductAttention(
        heads, dim, num_gqa_groups=kv_heads, attn_mask_type=mask_type, qkv_format=fmt,
        softmax_scale=scale,
    )  # fmt: skip


def _te(q, k, v, causal, scale, cu_seqlens, max_seqlen):  # type: ignore[no-untyped-def]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    heads, kv_heads, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    if cu_seqlens is not None:
        mask_type = "padding_causal" if causal else "padding"
        mod = _te_module(heads, kv_heads, dim, mask_type, "thd", scale)
        q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
        cu = cu_seqlens.to(torch.int32)
        max_len = max_seqlen or q3.shape[0]  # an upper bound: no device sync
        out = mod(q3, k3, v3, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                  max_seqlen_kv=max_len)  # fmt: skip
    else:
        mod = _te_module(heads, kv_heads, dim, "causal" if causal else "no_mask", "bshd", scale)
        out = mod(q, k, v)
    return out.reshape(q.shape)


# --------------------------------------------------------------------------- entry point


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    scale: float | None = None,
    mask: Any = None,
    backend: str | None = None,
) -> Tensor:
    """Scaled dot-product attention through the chosen backend (layout in the module doc)."""
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            f"attention: q/k/v must be [batch, seq, heads, head_dim] (or packed [tokens, heads, "
            f"head_dim] with cu_seqlens), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dim() == 3 and cu_seqlens is None:
        raise ValueError("attention: packed [tokens, heads, head_dim] inputs need cu_seqlens")
    if q.shape[-2] % k.shape[-2] or k.shape != v.shape:
        raise ValueError(
            f"attention: heads_q={q.shape[-2]} must be a multiple of heads_kv={k.shape[-2]} "
            f"and k {tuple(k.shape)} must equal v {tuple(v.shape)}"
        )
    name = select_backend(q, cu_seqlens=cu_seqlens, mask=mask, backend=backend)
    if _is_block_mask(mask) and name != "flex":
        raise ValueError(f"attention: a FlexAttention BlockMask needs backend='flex', not {name!r}")
    if name in ("flash_attn", "te"):
        if mask is not None:
            raise AttentionBackendUnavailableError(
                f"attention backend {name!r} takes no arbitrary mask; use backend='flex' "
                "(BlockMask) or 'sdpa' for dense masks"
            )
        fn = _flash_attn if name == "flash_attn" else _te
        return fn(q, k, v, causal, scale, cu_seqlens, max_seqlen)
    if name == "varlen":
        if mask is not None:
            raise AttentionBackendUnavailableError(
                "attention backend 'varlen' takes no mask; pass cu_seqlens alone"
            )
        return _varlen(q, k, v, causal, scale, cu_seqlens, max_seqlen)
    if name == "flex":
        if cu_seqlens is not None:
            q4, k4, v4 = (t.unsqueeze(0) if t.dim() == 3 else t for t in (q, k, v))
            out = _flex(q4, k4, v4, causal, mask, scale, cu_seqlens)
        else:
            out = _flex(q, k, v, causal, mask, scale, None)
        return out.reshape(q.shape)
    if cu_seqlens is not None:
        q4, k4, v4, mask = _varlen_inputs(q, k, v, cu_seqlens, mask)
    else:
        q4, k4, v4 = q, k, v
    if name == "eager":
        out = eager_attention(q4, k4, v4, causal=causal, mask=mask, scale=scale)
    else:
        out = _sdpa(q4, k4, v4, causal, mask, scale, _SDPA[name])
    return out.reshape(q.shape)

"""State-dict pieces the Qwen ViT adapters (``qwen2_5_vl`` / ``qwen3_vl`` ``vision_hf``)
share: where a checkpoint keeps the tower, the shape check, the per-head ``qkv`` reorder
between HF and megatron, and cutting / joining tensor-parallel parts.

Each family keeps its own names, shapes and which tensors are split how (its ``tp_kind``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

HF_PREFIXES = ("model.visual.", "visual.")
"""Where a full Qwen-VL checkpoint keeps the vision tower (transformers 5, then 4)."""


class VisionStateDictError(ValueError):
    """A state dict does not fit the vision config; the message names every key."""


def detect_hf_prefix(state_dict: Mapping[str, torch.Tensor]) -> str:
    """``model.visual.``, ``visual.`` or ``""`` (a bare vision-tower state dict)."""
    for prefix in HF_PREFIXES:
        if any(k.startswith(prefix) for k in state_dict):
            return prefix
    return ""


def check_state_dict(
    got: Mapping[str, torch.Tensor], want: Mapping[str, tuple[int, ...]], prefix: str, what: str
) -> None:
    """Raise ``VisionStateDictError`` naming every missing, unexpected and wrongly shaped key
    of ``got`` against the shapes ``want`` (names shown with ``prefix``)."""
    problems = []
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    if missing:
        problems.append(f"missing {[prefix + k for k in missing]}")
    if unexpected:
        problems.append(f"unexpected {[prefix + k for k in unexpected]}")
    bad = [
        f"{prefix}{k}: {tuple(got[k].shape)} != expected {want[k]}"
        for k in sorted(set(got) & set(want))
        if tuple(got[k].shape) != want[k]
    ]
    if bad:
        problems.append("wrong shapes " + "; ".join(bad))
    if problems:
        raise VisionStateDictError(
            f"{what} does not match the vision config: " + " | ".join(problems)
        )


def qkv_to_megatron(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """HF's fused ``qkv`` (all q heads, then all k, then all v) -> megatron's ``linear_qkv``
    (q, k, v of head 0, then head 1, ...)."""
    tail = x.shape[1:]
    x = x.reshape(3, num_heads, head_dim, *tail).transpose(0, 1)
    return x.reshape(3 * num_heads * head_dim, *tail).contiguous()


def qkv_to_hf(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`qkv_to_megatron`."""
    tail = x.shape[1:]
    x = x.reshape(num_heads, 3, head_dim, *tail).transpose(0, 1)
    return x.reshape(3 * num_heads * head_dim, *tail).contiguous()


def shard_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    tp_rank: int,
    tp_size: int,
    tp_kind: Callable[[str], str],
) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``tp_rank``'s part of an unsharded tower state dict; ``tp_kind``
    names each tensor's split: ``rows``, ``cols``, ``gate_up`` (gate rows then up rows, each
    split by rows) or ``replicated``."""
    out: dict[str, torch.Tensor] = {}
    for name, x in state_dict.items():
        kind = tp_kind(name)
        if kind == "rows":
            out[name] = x.chunk(tp_size, 0)[tp_rank].clone()
        elif kind == "gate_up":
            gate, up = x.chunk(2, 0)
            out[name] = torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]])
        elif kind == "cols":
            out[name] = x.chunk(tp_size, 1)[tp_rank].clone()
        else:
            out[name] = x.clone()
    return out


def unshard_state_dict(
    shards: Sequence[Mapping[str, torch.Tensor]], tp_kind: Callable[[str], str]
) -> dict[str, torch.Tensor]:
    """The unsharded tower state dict from every rank's part (in rank order): the inverse of
    :func:`shard_state_dict` with the same ``tp_kind``."""
    out: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        kind = tp_kind(name)
        if kind == "rows":
            out[name] = torch.cat(parts, 0)
        elif kind == "gate_up":
            halves = [p.chunk(2, 0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
        elif kind == "cols":
            out[name] = torch.cat(parts, 1)
        else:
            out[name] = parts[0]
    return out

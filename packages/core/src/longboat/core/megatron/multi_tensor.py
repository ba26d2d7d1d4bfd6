"""Multi-tensor gradient norm and scale for megatron-core without apex / Transformer Engine.

Without apex or Transformer Engine, megatron-core 0.19 falls back to per-tensor loops for
the gradient norm and clipping (``megatron.core.utils.local_multi_tensor_l2_norm`` /
``local_multi_tensor_scale``). The norm loop turns every gradient's norm into a host float
(``torch.tensor(list_of_device_scalars)``): one device synchronisation per parameter tensor
each step (about 600 for a 3B VLM), which stalls the host behind the whole backward. The
replacements here use torch's fused ``_foreach`` kernels and stay on the device until
megatron itself reads the total norm. They keep megatron's applier signature
(``op(chunk_size, noop_flag, tensor_lists, *args)``) and are installed only where megatron
chose its local fallback.
"""

from __future__ import annotations

import importlib

import torch

from longboat.core.megatron._patching import PatchSet

_FALLBACK_MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")


def foreach_l2_norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
    per_tensor: bool, *args: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The L2 norm over all tensors of ``tensor_lists[0]`` as a one-element fp32 tensor on
    their device (and the per-tensor norms when ``per_tensor``); no host synchronisation."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32))
    total = torch.linalg.vector_norm(norms).reshape(1)
    return total, (norms if per_tensor else None)


def foreach_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
    scale: float, *args: object,
) -> None:  # fmt: skip
    """``dst = src * scale`` for the pairs of ``tensor_lists[0]`` / ``[1]`` in fused kernels
    (in place where they are the same tensors; casting where their dtypes differ)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if len(src) != len(dst):
        raise ValueError(f"foreach_scale: {len(src)} sources for {len(dst)} destinations")
    if not src:
        return
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def multi_tensor_fallbacks() -> PatchSet:
    """Point megatron's local multi-tensor fallbacks at :func:`foreach_l2_norm` /
    :func:`foreach_scale`; a module that found apex or Transformer Engine keeps their
    kernels. Undo with the returned patch set's ``undo()``."""
    from megatron.core import utils as mutils

    swaps = {
        "l2_norm_impl": (mutils.local_multi_tensor_l2_norm, foreach_l2_norm),
        "multi_tensor_scale_impl": (mutils.local_multi_tensor_scale, foreach_scale),
    }
    patches = PatchSet()
    for name in _FALLBACK_MODULES:
        module = importlib.import_module(name)
        for attr, (local, fused) in swaps.items():
            if getattr(module, attr, None) is local:
                patches.set_attr(module, attr, fused)
    return patches

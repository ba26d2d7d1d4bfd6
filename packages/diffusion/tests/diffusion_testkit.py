"""Helpers the diffusion model tests share: seeded inputs, megatron's parallel state in a
worker, gradients gathered over tensor parallelism, a loss with activation recompute."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Standard normal ``shape`` from its own generator seeded with ``seed``."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@contextmanager
def tensor_parallel_state(world: int, seed: int = 3) -> Iterator[None]:
    """megatron's parallel state at ``tensor_parallel=world`` on the CPU for the body."""
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(
        ParallelConfig(tensor_parallel=world), get_accelerator("cpu"), seed=seed
    )
    try:
        yield
    finally:
        parallel_state.destroy()


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, tensor-parallel slices gathered into the full tensor."""
    from longboat.core.megatron.hf_io import rank_coords, tp_shards

    coords = rank_coords()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach()
        if coords.tp_size > 1 and getattr(p, "tensor_model_parallel", False):
            g = torch.cat(tp_shards(g, coords), dim=p.partition_dim)
        out[name] = g.clone()
    return out


def loss_and_grads(
    model: Any,
    first_block: torch.nn.Module,
    forward: Callable[[], torch.Tensor],
    target: torch.Tensor,
    recompute: int,
    *,
    recompute_attention: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int, int]:
    """Mean squared error of ``forward()`` against ``target`` with ``model.recompute_blocks =
    recompute`` (and ``model.recompute_attention``), after its backward: ``(loss,
    full_grads(model), calls of first_block, self-attention kernels run in the backward)`` (a
    recomputed block runs twice; its self-attention kernel too unless its outputs are kept)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from longboat.diffusion.models.common.recompute import is_self_attention

    class CountAttention(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            CountAttention.calls += is_self_attention(func, args)
            return func(*args, **(kwargs or {}))

    calls: list[int] = []
    hook = first_block.register_forward_pre_hook(lambda *a: calls.append(1))
    model.recompute_blocks = recompute
    model.recompute_attention = recompute_attention
    model.zero_grad(set_to_none=True)
    try:
        loss = (forward() - target).pow(2).mean()
        with CountAttention():
            loss.backward()
    finally:
        hook.remove()
        model.recompute_blocks = 0
        model.recompute_attention = False
    return loss.detach(), full_grads(model), len(calls), CountAttention.calls


def check_recompute(res: dict[str, Any], key: str, attention_calls: int, tol: float) -> None:
    """Assert what a model test's worker recorded with ``loss_and_grads`` (no recompute under
    ``loss`` / ``grads`` / ``calls`` / ``attn``, every block recomputed under the ``_<key>``
    suffix: ``rc`` keeping the self-attention outputs, ``rc_full`` recomputing it): block 0
    re-ran, the self-attention kernels ran in the backward only for ``rc_full`` (one per
    forward call, ``attention_calls``), and the loss and every gradient equal within ``tol``
    (max abs), every parameter getting one."""
    assert res["calls"] == 1 and res[f"calls_{key}"] == 2  # block 0 really re-ran
    assert res["attn"] == 0
    assert res[f"attn_{key}"] == (attention_calls if key == "rc_full" else 0)
    assert abs(res["loss"] - res[f"loss_{key}"]).item() <= tol
    grads, grads_rc = res["grads"], res[f"grads_{key}"]
    assert grads.keys() == grads_rc.keys()
    nonzero = 0
    for name, g in grads.items():
        assert g.shape == grads_rc[name].shape, name
        assert (g - grads_rc[name]).abs().max().item() <= tol, name
        nonzero += bool(g.abs().max() > 0)
    assert nonzero == len(grads)  # every parameter gets a gradient

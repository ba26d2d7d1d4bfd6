"""What a model saves for its backward, block by block, measured with saved-tensor hooks.

``measure_saved`` runs one forward (and the loss) under
``torch.autograd.graph.saved_tensors_hooks`` and forward hooks on the model's blocks, and
records every tensor autograd keeps for the backward by its storage (a storage counted once,
however many views of it are saved), apart from the parameters and the batch: which block
saved it (or none: embeddings, heads, the loss) and which storages each block took as input
(what a recomputed block keeps instead of its activations).

It runs on any device: on ``meta`` a forward at the run's real shapes allocates nothing, so
the profile of a multi-billion-parameter model at its real batch shapes costs a second of
host time. ``meta`` has no autocast and no fused attention, so there ``MetaDeviceOps`` casts
the operands of the ops that autocast runs in bf16 (matmuls, convolutions, attention) as
autocast would, weights included (the bf16 copies of fp32 weights that autocast keeps for
the backward are counted, as on the device), and runs attention as a fused kernel. Ops that
dispatch on the tensors' device to custom kernels need their own stand-in (e.g.
``longboat.kernels.meta_stands_for``, which the caller enters).

``ActivationProfile`` holds two such measurements (micro-batches of ``b1`` and ``b2``
samples) and extrapolates linearly to the run's micro-batch: saved bytes are a per-sample
part plus a fixed one (autocast's weight copies, shared tables).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_LOW_PRECISION_OPS = frozenset(
    {
        torch.nn.functional.linear,
        torch.nn.functional.conv1d,
        torch.nn.functional.conv2d,
        torch.nn.functional.conv3d,
        torch.nn.functional.scaled_dot_product_attention,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.einsum,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
    }
)
"""Ops autocast runs in the low-precision dtype (its list for matmuls, convolutions and
attention, as the emulation on ``meta`` needs it)."""


def _fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as a GPU runs it: a fused kernel that keeps q, k, v,
    the output and the log-sum-exp for the backward (with a boolean mask, its additive
    float form too), never the attention matrix (what the math fallback on ``meta`` keeps)."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(
            bias.logical_not(), float("-inf")
        )
    if bias is not None:
        bias = bias.expand(*q.shape[:-2], q.shape[-2], k.shape[-2])
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, dropout_p, is_causal, scale=scale
    )
    return out[0]


class MetaDeviceOps(TorchFunctionMode):
    """What the device does that ``meta`` does not, for a probe forward on ``meta``:
    autocast's casts (the floating operands of ``_LOW_PRECISION_OPS`` cast to ``dtype``;
    None: no autocast), attention through a fused kernel (``_fused_attention``), and a
    truth value for a 0-d check on the host (False)."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.dtype is not None and func in _LOW_PRECISION_OPS:
            dtype = self.dtype

            def cast(x: Any) -> Any:
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                    return x.to(dtype)
                return x

            args, kwargs = tree_map(cast, (args, kwargs))
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _fused_attention(*args, **kwargs)
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            # A meta tensor has no value to read: a model's batch checks (``if
            # bad.any(): raise``) pass; the run checks the real batches itself.
            return False
        return func(*args, **kwargs)


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (the same for every view of it, on any device)."""
    return t.untyped_storage()._cdata


def _storages(obj: Any) -> dict[int, int]:
    leaves, _ = tree_flatten(obj)
    return {
        storage_key(x): x.untyped_storage().nbytes() for x in leaves if isinstance(x, torch.Tensor)
    }


@dataclass
class SavedBytes:
    """One forward's saved storages: ``{storage: nbytes}`` per block and outside the blocks,
    and the storages each block took as input."""

    blocks: list[dict[int, int]]
    """Storages saved inside block i (attributed to the innermost running block)."""
    outside: dict[int, int]
    """Storages saved outside every block (embeddings, heads, the loss)."""
    block_inputs: list[dict[int, int]]
    """Tensor storages block i was called with (its input activations, masks, tables)."""
    batch_bytes: int = 0
    """Bytes of the batch's tensors."""

    def total(self, recompute: Iterable[int] = ()) -> int:
        """Saved bytes at the end of the forward when the blocks ``recompute`` are recomputed
        in the backward: those keep only their inputs (each storage counted once)."""
        redo = set(recompute)
        kept: dict[int, int] = dict(self.outside)
        for i, saved in enumerate(self.blocks):
            kept.update(self.block_inputs[i] if i in redo else saved)
        return sum(kept.values())

    def block_bytes(self, i: int) -> int:
        """Bytes block ``i`` saves (what its recompute brings back during the backward)."""
        return sum(self.blocks[i].values())

    def input_bytes(self, i: int) -> int:
        """Bytes of block ``i``'s input storages."""
        return sum(self.block_inputs[i].values())


@contextmanager
def _block_tracking(blocks: Sequence[nn.Module], stack: list[int], inputs: list[dict]):
    handles = []
    for i, block in enumerate(blocks):

        def pre(_m: nn.Module, args: Any, kwargs: Any, i: int = i) -> None:
            stack.append(i)
            inputs[i].update(_storages((args, kwargs)))

        def post(_m: nn.Module, _args: Any, _kwargs: Any, _out: Any) -> None:
            stack.pop()

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def measure_saved(
    model: nn.Module,
    run: Callable[[Any], Any],
    batch: Any,
    *,
    blocks: Sequence[nn.Module] = (),
    autocast_dtype: torch.dtype | None = None,
) -> SavedBytes:
    """Run ``run(batch)`` (the forward and loss of ``model``) once with grad enabled and
    return what it saved for the backward (module doc). ``blocks``: the model's repeated
    blocks, each called through its ``forward``; ``autocast_dtype``: run under autocast to it
    (emulated on ``meta``), None: no autocast."""
    params = {storage_key(p) for p in model.parameters()}
    params.update(storage_key(b) for b in model.buffers())
    batch_storages = _storages(batch)
    stack: list[int] = []
    saved: list[dict[int, int]] = [{} for _ in blocks]
    inputs: list[dict[int, int]] = [{} for _ in blocks]
    outside: dict[int, int] = {}
    skip = params | set(batch_storages)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in skip:
            (saved[stack[-1]] if stack else outside)[key] = t.untyped_storage().nbytes()
        return t

    device = next(iter(model.parameters())).device
    with ExitStack() as ctx:
        ctx.enter_context(torch.enable_grad())
        ctx.enter_context(_block_tracking(blocks, stack, inputs))
        ctx.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        if device.type == "meta":
            ctx.enter_context(MetaDeviceOps(autocast_dtype))
        elif autocast_dtype is not None:
            ctx.enter_context(torch.autocast(device.type, dtype=autocast_dtype))
        run(batch)
    for block_inputs in inputs:
        for key in skip:
            block_inputs.pop(key, None)
    # A block input that another block saved stays alive anyway; one only some block saw
    # as input (a mask, a table) is charged to a recomputed block that takes it.
    return SavedBytes(saved, outside, inputs, batch_bytes=sum(batch_storages.values()))


@dataclass
class ActivationProfile:
    """Saved bytes at two micro-batch sizes; linear in between and beyond (module doc)."""

    small: SavedBytes
    large: SavedBytes
    small_batch: int
    large_batch: int
    block_names: list[str] = field(default_factory=list)
    """A name per block (for reports)."""

    def _linear(self, f: Callable[[SavedBytes], int], batch: int) -> int:
        a, b = f(self.small), f(self.large)
        slope = (b - a) / (self.large_batch - self.small_batch)
        return max(0, round(a + slope * (batch - self.small_batch)))

    @property
    def num_blocks(self) -> int:
        """How many blocks the profile tracks."""
        return len(self.small.blocks)

    def saved(self, batch: int, recompute: Iterable[int] = ()) -> int:
        """Bytes saved for the backward at a micro-batch of ``batch`` samples with the blocks
        ``recompute`` recomputed."""
        redo = tuple(recompute)
        return self._linear(lambda s: s.total(redo), batch)

    def block_bytes(self, batch: int, i: int) -> int:
        """Bytes block ``i`` saves at ``batch`` samples."""
        return self._linear(lambda s: s.block_bytes(i), batch)

    def input_bytes(self, batch: int, i: int) -> int:
        """Bytes of block ``i``'s inputs at ``batch`` samples."""
        return self._linear(lambda s: s.input_bytes(i), batch)

    def batch_bytes(self, batch: int) -> int:
        """Bytes of a micro-batch of ``batch`` samples on the device."""
        return self._linear(lambda s: s.batch_bytes, batch)


def profile_activations(
    model: nn.Module,
    run: Callable[[Any], Any],
    make_batch: Callable[[int], Any],
    *,
    blocks: Sequence[nn.Module] = (),
    autocast_dtype: torch.dtype | None = None,
    sizes: tuple[int, int] = (1, 2),
) -> ActivationProfile:
    """``measure_saved`` at micro-batches of ``sizes`` samples (``make_batch(n)``), as an
    ``ActivationProfile``."""
    small, large = (
        measure_saved(model, run, make_batch(n), blocks=blocks, autocast_dtype=autocast_dtype)
        for n in sizes
    )
    names = {id(m): n for n, m in model.named_modules()}
    return ActivationProfile(
        small, large, sizes[0], sizes[1], [names.get(id(b), type(b).__name__) for b in blocks]
    )

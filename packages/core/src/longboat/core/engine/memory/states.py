"""Bytes of a model's weights, gradients, master weights and optimizer moments: counted
exactly from its parameters and an ``OptimizerLayout`` (what the step engine's optimizer
allocates), so they need no device."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

MASTER_BYTES = {"fp32": 4, "split": 2, "bf16_sr": 0}
"""Bytes a parameter of master weights per ``OptimizerLayout.master_storage``: a flat fp32
master buffer, the bf16 weights plus int16 low halves, or none (bf16 weights updated with
stochastic rounding)."""
MASTER_STORAGES = tuple(MASTER_BYTES)
"""``OptimizerLayout.master_storage`` values."""


@dataclass(frozen=True, kw_only=True)
class OptimizerLayout:
    """How the step engine stores a run's trainable parameters and optimizer state."""

    master_weights: bool = False
    """bf16 trainable weights and grads (2 bytes each a parameter) with fp32 masters in the
    optimizer (the torch engine's ``MasterWeightAdamW``, the megatron engine's distributed
    optimizer); False: the parameters' own dtype for weights and grads, no masters."""
    master_storage: str = "fp32"
    """With master weights: ``fp32`` (4 bytes a parameter), ``split`` (2: an int16 low half
    beside the bf16 weight) or ``bf16_sr`` (0: stochastic rounding, changes numerics)."""
    moments: int = 2
    """Optimizer moments per parameter: AdamW 2, SGD with momentum 1."""
    moment_bytes: int = 4
    """Bytes of one moment element: 4 (fp32) or 2 (bf16 moments)."""
    align: int = 1
    """Element alignment of each parameter inside the optimizer's flat buffers (master
    weights: ``master_weights.ALIGN``; 1: no flat buffers)."""
    scratch_elements: int = 0
    """fp32 scratch elements the update keeps (the master-weight slice path's grad scratch;
    with split or bf16_sr storage a second one of the same size, with bf16 moments two
    more)."""
    state_shards: int = 1
    """Ranks the masters and moments are sharded over (ZeRO-1, FSDP, the distributed
    optimizer); 1: replicated."""
    param_shards: int = 1
    """Ranks the weights and grads are sharded over (FSDP); 1: replicated."""
    param_bytes: int | None = None
    """Bytes of a trainable weight and its grad without master weights (None: the
    parameter's own element size)."""

    def __post_init__(self) -> None:
        if self.master_storage not in MASTER_STORAGES:
            raise ValueError(
                f"OptimizerLayout.master_storage={self.master_storage!r}: use one of "
                f"{MASTER_STORAGES}"
            )
        if self.moment_bytes not in (2, 4):
            raise ValueError(f"OptimizerLayout.moment_bytes={self.moment_bytes}: use 4 or 2")
        if self.state_shards < 1 or self.param_shards < 1:
            raise ValueError("OptimizerLayout: shard counts must be >= 1")


@dataclass(frozen=True)
class StateBytes:
    """Bytes of a run's persistent training state on one rank, by kind."""

    weights: int
    """Trainable weights the model computes with."""
    grads: int
    """Their gradients."""
    masters: int
    """fp32 master weights (or their int16 low halves with split storage)."""
    moments: int
    """Optimizer moments."""
    frozen: int
    """Frozen weights (no grad, no optimizer state)."""
    scratch: int = 0
    """The update's scratch buffers."""
    extra: int = 0
    """Other persistent buffers of the run (e.g. an fp32 average of the weights)."""
    trainable_params: int = field(default=0, compare=False)
    """Trainable parameter count (unsharded, without alignment padding)."""
    frozen_params: int = field(default=0, compare=False)
    """Frozen parameter count."""

    @property
    def total(self) -> int:
        """All of it."""
        return (
            self.weights + self.grads + self.masters + self.moments + self.frozen
            + self.scratch + self.extra
        )  # fmt: skip

    def with_moment_bytes(self, moment_bytes: int, layout: OptimizerLayout) -> StateBytes:
        """The same state with moments of ``moment_bytes`` bytes instead of ``layout``'s."""
        return self.with_storage(layout, dataclasses.replace(layout, moment_bytes=moment_bytes))

    def with_storage(self, layout: OptimizerLayout, new: OptimizerLayout) -> StateBytes:
        """The same state (counted under ``layout``) under ``new``, which differs from it in
        ``moment_bytes`` and / or ``master_storage`` only."""
        if not self.moments:
            return self
        unit = self.moments // (layout.moments * layout.moment_bytes)  # elements a state shard
        masters = unit * MASTER_BYTES[new.master_storage] if new.master_weights else 0
        scratch = self.scratch
        if scratch:
            scratch = scratch // _scratch_copies(layout) * _scratch_copies(new)
        return dataclasses.replace(
            self, masters=masters, moments=unit * new.moments * new.moment_bytes, scratch=scratch
        )


def _scratch_copies(layout: OptimizerLayout) -> int:
    """fp32 scratch buffers of ``scratch_elements`` the update keeps (see the field)."""
    if not layout.master_weights:
        return 1
    extra = layout.master_storage != "fp32"
    return 1 + extra + (2 if layout.moment_bytes == 2 else 0)


def _shard(n: int, shards: int) -> int:
    return -(-n // shards)


def state_bytes(params: Iterable[nn.Parameter], layout: OptimizerLayout) -> StateBytes:
    """Exact bytes of ``params`` (a model's parameters: ``requires_grad`` says which train;
    any device, ``meta`` included) under ``layout``, per rank."""
    trainable_elems = padded = frozen = frozen_elems = own_bytes = 0
    a = layout.align
    for p in params:
        n = p.numel()
        if p.requires_grad:
            trainable_elems += n
            padded += -(-n // a) * a
            own_bytes += n * p.element_size()
        else:
            frozen_elems += n
            frozen += n * p.element_size()
    if layout.master_weights:
        weights = grads = 2 * padded
        masters = MASTER_BYTES[layout.master_storage] * padded
        moments = layout.moments * layout.moment_bytes * padded
        # The slice path's scratch holds one slice: never more than the buffers.
        scratch_elems = min(layout.scratch_elements, padded)
        scratch = 4 * scratch_elems * _scratch_copies(layout)
    else:
        weights = grads = own_bytes if layout.param_bytes is None else layout.param_bytes * padded
        masters = 0
        moments = layout.moments * layout.moment_bytes * padded
        scratch = 4 * min(layout.scratch_elements, padded)
    return StateBytes(
        weights=_shard(weights, layout.param_shards),
        grads=_shard(grads, layout.param_shards),
        masters=_shard(masters, layout.state_shards),
        moments=_shard(moments, layout.state_shards),
        frozen=frozen,
        scratch=scratch,
        trainable_params=trainable_elems,
        frozen_params=frozen_elems,
    )

"""Data-parallel strategies of the torch step engine: ddp, zero1, fsdp (FSDP2), hsdp.

``parallelize`` turns a plain ``nn.Module`` (already on its device) into the
module the training loop calls. The matching optimizer comes from
``longboat.core.engine.torch.optim.build_optimizer``, which needs the same
``ParallelSetup`` (ZeRO-1 shards the optimizer state, not the module).

The strategy names are core's (``longboat.core.distributed.STRATEGIES``); core's validator
checks ``parallel.strategy`` and ``parallel.data_parallel_replicate`` when the config is
composed, and ``resolve_parallel`` resolves them against the world size before
``ParallelSetup`` is built, so this module does not check them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import STRATEGIES
from longboat.core.engine import MASTER_WEIGHT_STRATEGIES
from longboat.core.engine.torch.blocks import block_methods, find_blocks
from longboat.core.engine.torch.recompute import apply_activation_checkpointing

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ParallelSetup:
    """Resolved data-parallel layout of this process."""

    strategy: str
    """ddp, zero1, fsdp or hsdp."""
    world_size: int
    """Processes in the job (all data parallel: the torch engine uses no TP/PP)."""
    rank: int
    """This process's global rank."""
    replicate: int = 1
    """HSDP only: replica groups (mesh dim 0); world_size / replicate shards each."""
    device_type: str = "cpu"
    """torch device type of the accelerator (``cpu``, ``cuda``...)."""

    @classmethod
    def from_config(
        cls, parallel: Any, *, world_size: int, rank: int, device_type: str
    ) -> ParallelSetup:
        """The layout of ``parallel.*`` (``parallel.strategy``,
        ``parallel.data_parallel_replicate``; resolved and validated by core's
        ``resolve_parallel``) for this process."""
        return cls(
            strategy=parallel.strategy,
            world_size=world_size,
            rank=rank,
            replicate=parallel.data_parallel_replicate,
            device_type=device_type,
        )

    @property
    def distributed(self) -> bool:
        """True when a process group with more than one rank is in use."""
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    @property
    def shard(self) -> int:
        """Shard-group size (FSDP: world_size; HSDP: world_size / replicate)."""
        return self.world_size // self.replicate if self.strategy == "hsdp" else self.world_size


def check_master_weights(strategy: str) -> None:
    """ConfigError unless ``strategy`` supports master weights (any world size: the
    sharded strategies keep their own parameter storage)."""
    if strategy not in MASTER_WEIGHT_STRATEGIES:
        raise ConfigError(
            f"master weights are not supported with {strategy} (its params are sharded "
            "or wrapped, so they cannot be views of one flat buffer)",
            key="train.master_weights",
            value=True,
            fix=f"set parallel.strategy={' or '.join(MASTER_WEIGHT_STRATEGIES)} or "
            "train.master_weights=false",
        )


def build_mesh(setup: ParallelSetup) -> DeviceMesh | None:
    """The device mesh for FSDP/HSDP (None when not distributed or not sharding)."""
    if not setup.distributed or setup.strategy not in ("fsdp", "hsdp"):
        return None
    if setup.strategy == "hsdp":
        return init_device_mesh(
            setup.device_type,
            (setup.replicate, setup.shard),
            mesh_dim_names=("replicate", "shard"),
        )
    return init_device_mesh(setup.device_type, (setup.world_size,), mesh_dim_names=("shard",))


def parallelize(
    model: nn.Module,
    setup: ParallelSetup,
    *,
    precision: str = "fp32",
    activation_checkpointing: str = "none",
    device_ids: list[int] | None = None,
    bucket_cap_mb: int = 25,
    find_unused_parameters: bool = True,
    master_weights: bool = False,
    known_block_methods: Sequence[str] = (),
) -> nn.Module:
    """Apply activation checkpointing, then the data-parallel strategy, to ``model``.

    - ``ddp`` / ``zero1``: DistributedDataParallel with bucketed all-reduce that
      overlaps backward (ZeRO-1 then shards the optimizer state, see optim.py).
    - ``fsdp``: FSDP2 ``fully_shard`` on every block, then on the root; with bf16
      the params are gathered in bf16 and gradients reduced in fp32.
    - ``hsdp``: the same on a 2-D (replicate, shard) mesh.

    With a single process the model is returned unwrapped (same math).
    ``master_weights`` (ddp only): the model is returned unwrapped at any world size;
    ``MasterWeightAdamW`` all-reduces its flat grad buffer with one collective instead
    (no overlap with backward, no per-bucket copies).
    ``find_unused_parameters`` (DDP/ZeRO-1) costs one autograd-graph walk per step;
    turn it off only for models whose every trainable parameter is used every step.
    ``known_block_methods``: methods other than ``forward`` through which the model runs a
    block (see ``blocks.block_methods``); FSDP gathers the block's params around them too.
    """
    if master_weights:
        check_master_weights(setup.strategy)
        if precision != "bf16":
            raise ConfigError(
                "master weights keep bf16 params; they need bf16 autocast",
                key="train.precision",
                value=precision,
                fix="set train.precision=bf16 or train.master_weights=false",
            )
    blocks = find_blocks(model)
    apply_activation_checkpointing(model, blocks, activation_checkpointing)
    if not setup.distributed or master_weights:
        return model
    if setup.strategy in ("ddp", "zero1"):
        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=True,
            # A model may have trainable params that a step does not use (a policy's
            # mask token that takes part only when its dropout fires); DDP must not wait
            # for their grads. Frozen params are never hooked, so they cost nothing.
            find_unused_parameters=find_unused_parameters,
        )
    if setup.strategy not in ("fsdp", "hsdp"):
        raise ValueError(f"unknown data-parallel strategy {setup.strategy!r}: one of {STRATEGIES}")
    mesh = build_mesh(setup)
    mp_policy = MixedPrecisionPolicy()
    if precision in ("bf16", "fp16"):
        mp_policy = MixedPrecisionPolicy(param_dtype=_DTYPES[precision], reduce_dtype=torch.float32)
    # Blocks are re-found because checkpoint wrappers replaced them in their parents.
    for block in find_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        for name in block_methods(block, known_block_methods):
            # Gather before / reshard after each of these calls, as for forward.
            register_fsdp_forward_method(block, name)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies in place: returned as is)."""
    return model.module if isinstance(model, DistributedDataParallel) else model

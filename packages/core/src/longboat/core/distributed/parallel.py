"""Parallel-config resolution and the DeviceMesh built from it."""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

from longboat.core.config.schema import PARALLEL_STRATEGIES, ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

STRATEGIES = PARALLEL_STRATEGIES
"""Valid ``parallel.strategy`` values for torch-native stacks."""


def resolve_parallel(parallel: ParallelConfig, world_size: int) -> ParallelConfig:
    """A copy of ``parallel`` with ``data_parallel`` resolved for ``world_size``.

    The layout is checked by the same rules the config validator applies at compose time
    (``longboat.core.config.validate.check_parallel``): one ``ConfigError`` listing every
    problem (key, value and fix), for a world size the composed config may not have known.
    """
    from longboat.core.config.validate import check_parallel

    return dataclasses.replace(parallel, data_parallel=check_parallel(parallel, world_size))


def mesh_shape(
    parallel: ParallelConfig, world_size: int
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Names and sizes of the mesh dims, outermost first: pp, dp (or dp_replicate, dp_shard), cp, tp.

    Only dims > 1 appear, plus the data-parallel dim(s) which always do, so
    ``mesh["dp"]`` (or ``mesh["dp_replicate", "dp_shard"]``) is always valid.
    """
    p = resolve_parallel(parallel, world_size)
    dims: list[tuple[str, int]] = []
    if p.pipeline_parallel > 1:
        dims.append(("pp", p.pipeline_parallel))
    if p.strategy == "hsdp":
        replicate = p.data_parallel_replicate
        dims += [("dp_replicate", replicate), ("dp_shard", p.data_parallel // replicate)]
    else:
        dims.append(("dp", p.data_parallel))
    if p.context_parallel > 1:
        dims.append(("cp", p.context_parallel))
    if p.tensor_parallel > 1:
        dims.append(("tp", p.tensor_parallel))
    names, sizes = zip(*dims, strict=True)
    return tuple(names), tuple(sizes)


def build_device_mesh(parallel: ParallelConfig, world_size: int, device_type: str) -> DeviceMesh:
    """A named DeviceMesh for ``parallel`` (see ``mesh_shape`` for the dims).

    For HSDP, ``dp_mesh(mesh)`` gives replicate x shard flattened into one ``dp``
    dim. Needs torch.distributed initialised with ``world_size`` ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = mesh_shape(parallel, world_size)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    if "dp_replicate" in names:
        # DP loaders and loss averaging want one dp group regardless of sharding layout;
        # torch wants the flattened mesh kept by the caller rather than sliced from the root.
        _FLAT_DP[mesh] = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


_FLAT_DP: weakref.WeakKeyDictionary[DeviceMesh, DeviceMesh] = weakref.WeakKeyDictionary()


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D data-parallel submesh of a mesh from ``build_device_mesh``.

    For HSDP this is replicate x shard flattened into one ``dp`` dim (e.g. for the
    data sampler's rank and size); otherwise ``mesh["dp"]``.
    """
    flat = _FLAT_DP.get(mesh)
    return flat if flat is not None else mesh["dp"]

"""Parallel-config resolution and the DeviceMesh built from it."""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

from longboat.core.config.errors import ProblemCollector
from longboat.core.config.schema import ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

STRATEGIES = ("ddp", "zero1", "fsdp", "hsdp")
"""Valid ``parallel.strategy`` values for torch-native stacks."""

_SIZE_KEYS = (
    "tensor_parallel",
    "pipeline_parallel",
    "context_parallel",
    "expert_parallel",
    "data_parallel_replicate",
)


def resolve_parallel(parallel: ParallelConfig, world_size: int) -> ParallelConfig:
    """A copy of ``parallel`` with ``data_parallel`` resolved and every size checked.

    Raises one ``ConfigError`` listing every problem (key, value and fix):
    world_size != tp * pp * cp * dp, sizes < 1, EP not dividing dp * cp,
    HSDP replicas not dividing dp, unknown strategy, virtual stages without PP.
    """
    problems = ProblemCollector()
    if not isinstance(world_size, int) or world_size < 1:
        problems.add("world_size", "must be a positive int", value=world_size)
        problems.raise_if_any()
    for key in _SIZE_KEYS:
        value = getattr(parallel, key)
        if not isinstance(value, int) or value < 1:
            problems.add(
                f"parallel.{key}", "must be an int >= 1", value=value, fix="use 1 to disable"
            )
    problems.raise_if_any()

    tp, pp, cp = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.context_parallel
    model_parallel = tp * pp * cp
    dp = parallel.data_parallel
    if dp == -1:
        if world_size % model_parallel:
            problems.add(
                "parallel",
                f"world size {world_size} is not divisible by tensor_parallel * pipeline_parallel"
                f" * context_parallel = {tp} * {pp} * {cp} = {model_parallel}",
                fix=f"launch a multiple of {model_parallel} processes or shrink tp/pp/cp",
            )
            problems.raise_if_any()
        dp = world_size // model_parallel
    elif not isinstance(dp, int) or dp < 1:
        problems.add("parallel.data_parallel", "must be -1 (auto) or an int >= 1", value=dp)
        problems.raise_if_any()
    elif model_parallel * dp != world_size:
        problems.add(
            "parallel.data_parallel",
            f"tp * pp * cp * dp = {tp} * {pp} * {cp} * {dp} = {model_parallel * dp} "
            f"but the world size is {world_size}",
            value=dp,
            fix=f"set parallel.data_parallel=-1 to infer it, or launch {model_parallel * dp} processes",
        )
        problems.raise_if_any()

    ep, tp = parallel.expert_parallel, parallel.tensor_parallel
    # megatron-core (expert tensor parallel 1) carves EP groups out of the tp x dp x cp ranks.
    if (tp * dp * cp) % ep:
        problems.add(
            "parallel.expert_parallel",
            f"must divide tensor * data * context parallel = {tp} * {dp} * {cp} = {tp * dp * cp}",
            value=ep,
            fix="pick an expert_parallel that divides tp * dp * cp",
        )
    replicate = parallel.data_parallel_replicate
    if dp % replicate:
        problems.add(
            "parallel.data_parallel_replicate",
            f"must divide data_parallel={dp}",
            value=replicate,
            fix="choose replicas so dp = replicate * shard",
        )
    if parallel.strategy not in STRATEGIES:
        problems.add(
            "parallel.strategy",
            "unknown data-parallel strategy",
            value=parallel.strategy,
            fix=f"use one of {', '.join(STRATEGIES)}",
        )
    elif replicate > 1 and parallel.strategy != "hsdp":
        problems.add(
            "parallel.data_parallel_replicate",
            f"replicas > 1 need parallel.strategy=hsdp (got {parallel.strategy!r})",
            value=replicate,
            fix="set parallel.strategy=hsdp or parallel.data_parallel_replicate=1",
        )
    vpp = parallel.virtual_pipeline_parallel
    if vpp is not None:
        if not isinstance(vpp, int) or vpp < 1:
            problems.add("parallel.virtual_pipeline_parallel", "must be None or >= 1", value=vpp)
        elif vpp > 1 and pp == 1:
            problems.add(
                "parallel.virtual_pipeline_parallel",
                "interleaved stages need pipeline_parallel > 1",
                value=vpp,
                fix="set parallel.virtual_pipeline_parallel=null or raise pipeline_parallel",
            )
    problems.raise_if_any()
    return dataclasses.replace(parallel, data_parallel=dp)


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

"""The vision tower unsharded (ViT TP=1) under a tensor-parallel decoder: data-parallel
encoding over the decoder's TP group.

A ViT is small next to its decoder and its sequences are many short images, so splitting
its matmuls over the decoder's TP ranks costs two all-reduces per block for little saving.
With ``model.vision_tensor_parallel=1`` under ``parallel.tensor_parallel=T`` every rank
holds the whole tower, built with its own one-rank TP group (megatron's layers take their
groups explicitly: ``pg_collection`` for the blocks, ``tp_group`` for the mergers; the
global parallel state is not touched), and the images of a microbatch are divided among
the ``T`` ranks of the decoder's TP group:

- ``assign_images``: each image (grid row) goes to one rank, dealt by core's ``balance`` on
  its ViT cost (a pure function of the grids, so every rank computes the same deal);
- ``encode_split``: each rank runs the tower on its own images, then the outputs are
  all-gathered within the group (padded to the longest rank's) and put back in input
  order. The decoder's input is replicated over TP and so is its gradient (the first
  layer's column-parallel linears all-reduce it), so the gather's backward keeps only this
  rank's rows: the tower needs no TP communication in the backward either;
- ``reduce_tower_grads``: each replica got gradients from its own images only, so the
  tower's accumulated gradients are summed over the group before the data-parallel
  reduction.

``replicate_tower`` makes the replicas equal at build (broadcast from TP rank 0) and marks
their parameters as TP duplicates, so megatron's grad norm counts them once per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longboat.core.config.errors import ConfigError

KEY = "model.vision_tensor_parallel"


def resolve_vision_tensor_parallel(
    value: int | None,
    tensor_parallel: int,
    pipeline_parallel: int = 1,
    *,
    family: str | None = None,
    supported: bool = True,
) -> int:
    """The tower's TP size for ``model.vision_tensor_parallel=value`` (null: the decoder's);
    a ``ConfigError`` naming the key for a size other than the decoder's or 1, for an
    unsharded tower under pipeline parallelism, or for a family (``supported=False``) that
    does not encode data-parallel."""
    if value is None or value == tensor_parallel:
        return tensor_parallel
    if not isinstance(value, int) or isinstance(value, bool) or value != 1:
        raise ConfigError(
            f"must be null (the decoder's parallel.tensor_parallel={tensor_parallel}), "
            f"{tensor_parallel} or 1",
            key=KEY,
            value=value,
            fix="set it to 1 (an unsharded tower, images divided over the TP ranks) or null",
        )
    if not supported:
        raise ConfigError(
            f"the {family} family does not support a vision tower unsharded under a "
            "tensor-parallel decoder",
            key=KEY,
            value=value,
            fix="set it to null",
        )
    if pipeline_parallel > 1:
        raise ConfigError(
            f"an unsharded tower is not supported with parallel.pipeline_parallel="
            f"{pipeline_parallel}",
            key=KEY,
            value=value,
            fix="set it to null, or parallel.pipeline_parallel=1",
        )
    return 1


@dataclass(frozen=True)
class VisionSplit:
    """How an unsharded tower divides a microbatch's images: over ``group``."""

    group: Any
    """The ranks among which images are divided (megatron's TP group of the decoder)."""
    size: int
    rank: int
    """This rank's position in ``group``."""
    tower_groups: Any
    """megatron ``ProcessGroupCollection`` for the tower's layers: the live ones with ``tp``
    this rank's one-rank group."""


def vision_split(vision_tensor_parallel: int | None) -> VisionSplit | None:
    """The split for ``model.vision_tensor_parallel`` under the live megatron parallel state:
    None when the tower shares the decoder's TP. Collective over the world (every rank
    creates every one-rank group, as torch requires)."""
    from megatron.core import parallel_state as mps
    from megatron.core.process_groups_config import ProcessGroupCollection

    tp = mps.get_tensor_model_parallel_world_size()
    pp = mps.get_pipeline_model_parallel_world_size()
    if resolve_vision_tensor_parallel(vision_tensor_parallel, tp, pp) == tp:
        return None
    own, _ = dist.new_subgroups(group_size=1)
    groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp"])
    groups.tp = own
    return VisionSplit(
        group=mps.get_tensor_model_parallel_group(),
        size=tp,
        rank=mps.get_tensor_model_parallel_rank(),
        tower_groups=groups,
    )


@torch.no_grad()
def replicate_tower(tower: torch.nn.Module, split: VisionSplit) -> None:
    """Make every replica of ``tower`` in ``split.group`` equal to TP rank 0's and mark its
    parameters as not tensor-parallel (megatron's grad norm then counts them on TP rank 0
    only, as it does the decoder's norms)."""
    src = dist.get_global_rank(split.group, 0)
    for p in tower.parameters():
        dist.broadcast(p.data, src=src, group=split.group)
        p.tensor_model_parallel = False
    for b in tower.buffers():
        if b.is_floating_point():
            dist.broadcast(b, src=src, group=split.group)


def image_costs(grid_thw: torch.Tensor, cfg: Any) -> list[float]:
    """The ViT cost of each image / video of ``grid_thw`` ``[n, 3]``: attention within each
    frame (quadratic in its ``h * w`` patches) and linears per patch, in the proportions of
    the tower's FLOPs (``cfg``: ``hidden_size``, ``intermediate_size``)."""
    from longboat.core.data.balance import CostModel

    h, ffn = cfg.hidden_size, cfg.intermediate_size
    model = CostModel(quadratic=2.0 * h, linear=4.0 * h * h + 2.0 * h * ffn)
    return [model.cost([hh * ww] * t) for t, hh, ww in grid_thw.tolist()]


def assign_images(grid_thw: torch.Tensor, cfg: Any, ranks: int) -> tuple[tuple[int, ...], ...]:
    """The images (rows of ``grid_thw``, ascending) each of ``ranks`` ranks encodes,
    balanced by ``image_costs``; deterministic, so every rank computes the same."""
    from longboat.core.data.balance import balance

    return balance(image_costs(grid_thw, cfg), ranks).ranks


class _GatherRows(torch.autograd.Function):
    """All-gather of equal-length row blocks over a group; the backward keeps this rank's
    block of the (replicated) incoming gradient."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, split: VisionSplit) -> torch.Tensor:
        ctx.split = split
        parts = [torch.empty_like(local) for _ in range(split.size)]
        dist.all_gather(parts, local.contiguous(), group=split.group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        split = ctx.split
        return grad.reshape(split.size, -1, *grad.shape[1:])[split.rank].contiguous(), None


def _parts(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    merged, extra = out
    return [merged, *extra]


def encode_split(
    tower: torch.nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor, split: VisionSplit
) -> Any:
    """``tower(pixels, grid_thw)`` computed with the images divided over ``split.group``
    (collective: every rank of the group calls it with the same inputs, a rank without
    images too). The output has the tower's own form: the merged tokens, or with deepstack
    features (``cfg.deepstack_visual_indexes``) ``(merged, [features])``, in input order.

    ``pixels`` rows are the images' ``t * h * w`` patches, image after image; each image
    gives ``t * h * w / spatial_merge_size**2`` output rows, image after image.
    """
    cfg = tower.cfg
    grid_thw = grid_thw.cpu()
    patches = grid_thw.prod(-1).tolist()
    unit = cfg.spatial_merge_size**2
    rows = [n // unit for n in patches]
    deal = assign_images(grid_thw, cfg, split.size)
    mine = deal[split.rank]
    width = cfg.out_hidden_size
    extra = getattr(cfg, "deepstack_visual_indexes", None)
    count = 1 + len(extra or ())
    dtype = tower.config.params_dtype
    if mine:
        starts = [0]
        for n in patches:
            starts.append(starts[-1] + n)
        take = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in mine])
        out = _parts(tower(pixels[take.to(pixels.device)], grid_thw[list(mine)]))
        local = torch.cat([o.to(dtype) for o in out], dim=-1)
    else:
        local = torch.zeros(0, width * count, dtype=dtype, device=pixels.device)
    longest = max(sum(rows[i] for i in r) for r in deal)
    local = F.pad(local, (0, 0, 0, longest - local.shape[0]))
    gathered = _GatherRows.apply(local, split)
    # Where each image's rows sit in the gathered blocks, in input order.
    place: dict[int, int] = {}
    for r, images in enumerate(deal):
        offset = r * longest
        for i in images:
            place[i] = offset
            offset += rows[i]
    index = torch.cat([torch.arange(place[i], place[i] + rows[i]) for i in range(len(rows))])
    full = gathered.index_select(0, index.to(gathered.device))
    parts = list(full.split(width, dim=-1))
    if extra is None:
        return parts[0]
    return parts[0], parts[1:]


def reduce_tower_grads(tower: torch.nn.Module, split: VisionSplit) -> None:
    """Sum the tower's accumulated gradients (megatron DDP's ``main_grad``) over
    ``split.group``: each replica saw only its own images. Call after the backward of every
    microbatch and before DDP's gradient reduction."""
    grads = [p.main_grad for p in tower.parameters() if p.requires_grad and hasattr(p, "main_grad")]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=split.group)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)

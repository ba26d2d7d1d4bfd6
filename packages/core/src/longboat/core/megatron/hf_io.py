"""Load a Hugging Face decoder checkpoint straight into megatron model chunks, and back.

Loading: every rank opens the safetensors files lazily and reads only the rows /
columns of its own TP shard, its own pipeline stage's layers and its own experts.
Before any tensor is read, the checkpoint is checked against the architecture
and every missing, unexpected or mis-shaped tensor is reported in one error.

Saving: TP shards are all-gathered inside each TP group; one owner rank per
tensor (TP rank 0 of data-parallel replica 0, or expert-data-parallel rank 0 for
experts) writes its tensors to its own shard, named as ``transformers`` names them
(``model.safetensors`` when one rank owns everything, else ``model-00001-of-0000N.safetensors``
plus ``model.safetensors.index.json``), so no rank ever holds the whole model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.hf_mapping import (
    FUSED_EXPERT_NAMES,
    RankCoords,
    Slot,
    expected_hf_shapes,
    fused_experts_for_file,
    megatron_to_hf_slot,
    shard_from_hf,
    unshard_to_hf,
)

# HF buffers that some exports contain but that are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFCheckpointMismatch(ValueError):
    """The HF checkpoint does not fit the chosen architecture; lists every offending tensor."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n  ".join(problems)
        super().__init__(
            f"{source}: {len(problems)} tensor problem(s) against the chosen model flavor:\n  "
            f"{lines}\nFix: pick the model flavor that matches this checkpoint's config.json."
        )


def hf_weight_index(hf_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of an HF directory (sharded or single file)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / fname for name, fname in weight_map.items()}
    single = hf_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(
        f"{hf_dir}: no model.safetensors or model.safetensors.index.json. Fix: point at a "
        "Hugging Face model directory saved with safetensors."
    )


def rank_coords() -> RankCoords:
    """This rank's tensor- and expert-parallel coordinates (megatron's parallel state)."""
    from megatron.core import parallel_state as mps

    return RankCoords(
        tp_rank=mps.get_tensor_model_parallel_rank(),
        tp_size=mps.get_tensor_model_parallel_world_size(),
        ep_rank=mps.get_expert_model_parallel_rank(),
        ep_size=mps.get_expert_model_parallel_world_size(),
    )


def _named_slots(
    chunks: list[torch.nn.Module],
    arch: DecoderModelConfig,
    coords: RankCoords,
    prefix: str,
    expert_layout: str = "per_expert",
) -> Iterator[tuple[str, torch.nn.Parameter, Slot]]:
    for chunk in chunks:
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        for name, param in chunk.named_parameters():
            global_layer = None
            if name.startswith("decoder.layers."):
                local = int(name.split(".")[2])
                global_layer = layers[local].layer_number - 1
            yield (
                name,
                param,
                megatron_to_hf_slot(
                    name,
                    arch,
                    global_layer=global_layer,
                    ep=coords,
                    prefix=prefix,
                    expert_layout=expert_layout,
                ),
            )


def check_hf_checkpoint(
    hf_dir: str | Path,
    arch: DecoderModelConfig,
    *,
    prefix: str = "model.",
    other_prefixes: tuple[str, ...] = (),
    expert_layout: str = "per_expert",
) -> dict[str, Path]:
    """Raise ``HFCheckpointMismatch`` naming every missing / unexpected / mis-shaped tensor.

    ``other_prefixes``: tensors of the checkpoint's other components (a VLM's ``visual.``),
    which another loader reads; they are not unexpected here. ``expert_layout``: how the
    checkpoint stores the routed experts (``hf_mapping.EXPERT_LAYOUTS``); fused expert
    tensors may hold their last two dimensions in either order."""
    expected = expected_hf_shapes(arch, prefix=prefix, expert_layout=expert_layout)
    return check_hf_tensors(
        hf_dir,
        expected,
        tie_embeddings=arch.tie_embeddings,
        other_prefixes=other_prefixes,
        transposable=frozenset(n for n in expected if n.endswith(FUSED_EXPERT_NAMES)),
    )


def check_hf_tensors(
    hf_dir: str | Path,
    expected: dict[str, tuple[int, ...]],
    *,
    tie_embeddings: bool,
    optional: set[str] | frozenset[str] = frozenset(),
    other_prefixes: tuple[str, ...] = (),
    transposable: frozenset[str] = frozenset(),
) -> dict[str, Path]:
    """The checkpoint's tensor index, after checking it against ``expected`` (name -> shape):
    raise ``HFCheckpointMismatch`` naming every missing (unless ``optional``), unexpected
    (a tied head, ``other_prefixes`` and rotary buffers excepted) or mis-shaped tensor
    (``transposable`` names may have their last two dimensions swapped)."""
    index = hf_weight_index(hf_dir)
    problems = [
        f"missing: {name} (expected shape {list(expected[name])})"
        for name in sorted(set(expected) - set(index) - set(optional))
    ]
    for name in sorted(set(index) - set(expected)):
        tied_head = tie_embeddings and name == "lm_head.weight"
        other = name.startswith(other_prefixes) if other_prefixes else False
        if not tied_head and not other and not name.endswith(_IGNORED_SUFFIXES):
            problems.append(f"unexpected: {name}")
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name in sorted(set(expected) & set(index)):
            path = index[name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), "pt"))
            shape = tuple(handles[path].get_slice(name).get_shape())
            want = expected[name]
            swapped = (*want[:-2], want[-1], want[-2]) if len(want) >= 2 else want
            if shape != want and not (name in transposable and shape == swapped):
                problems.append(
                    f"shape: {name} is {list(shape)} in the checkpoint, the model expects "
                    f"{list(expected[name])}"
                )
    if problems:
        raise HFCheckpointMismatch(str(hf_dir), problems)
    return index


@torch.no_grad()
def load_hf_weights(
    chunks: list[torch.nn.Module],
    arch: DecoderModelConfig,
    hf_dir: str | Path,
    *,
    prefix: str = "model.",
    other_prefixes: tuple[str, ...] = (),
    progress: Any = None,
    expert_layout: str = "per_expert",
) -> int:
    """Copy an HF checkpoint into this rank's megatron chunks; returns tensors loaded.

    ``progress`` (optional) is called with ``(done, total)`` after each tensor;
    ``other_prefixes`` and ``expert_layout`` as in ``check_hf_checkpoint``.
    """
    index = check_hf_checkpoint(
        hf_dir, arch, prefix=prefix, other_prefixes=other_prefixes, expert_layout=expert_layout
    )
    coords = rank_coords()
    slots = list(_named_slots(chunks, arch, coords, prefix, expert_layout))
    problems: list[str] = []
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(name: str, rows: Any, cols: Any) -> torch.Tensor:
            path = index[name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), "pt"))
            sl = handles[path].get_slice(name)
            shape = sl.get_shape()
            if len(shape) == 1:
                return sl[rows]
            if cols == "tp":
                per = shape[1] // coords.tp_size
                cols = slice(coords.tp_rank * per, (coords.tp_rank + 1) * per)
            return sl[rows, cols]

        for done, (name, param, slot) in enumerate(slots, 1):
            tensor = shard_from_hf(slot, read, arch, coords)
            if tuple(tensor.shape) != tuple(param.shape):
                problems.append(
                    f"shape: megatron {name} is {list(param.shape)} but {slot.hf_names} give "
                    f"{list(tensor.shape)} on this rank"
                )
                continue
            param.data.copy_(tensor.to(param.dtype))
            if progress is not None:
                progress(done, len(slots))
    if problems:
        raise HFCheckpointMismatch(str(hf_dir), problems)
    return len(slots)


def is_owner(slot: Slot) -> bool:
    """Whether this rank writes the HF tensors of ``slot`` (one owner per tensor)."""
    from megatron.core import parallel_state as mps

    if slot.kind.startswith("expert_fused"):  # gathered over the expert-parallel group
        return (
            mps.get_expert_data_parallel_rank() == 0 and mps.get_expert_model_parallel_rank() == 0
        )
    if slot.kind.startswith("expert"):
        return mps.get_expert_data_parallel_rank() == 0
    return (
        mps.get_tensor_model_parallel_rank() == 0
        and mps.get_data_parallel_rank(with_context_parallel=True) == 0
    )


@torch.no_grad()
def tp_shards(local: torch.Tensor, coords: RankCoords) -> list[torch.Tensor]:
    """Every tensor-parallel rank's ``local`` tensor, in rank order (collective over the TP
    group; ``[local]`` at TP 1)."""
    if coords.tp_size == 1:
        return [local]
    from megatron.core import parallel_state as mps

    shards = [torch.empty_like(local) for _ in range(coords.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=mps.get_tensor_model_parallel_group())
    return shards


def gather_hf_state_dict(
    chunks: list[torch.nn.Module],
    arch: DecoderModelConfig,
    *,
    prefix: str = "model.",
    expert_layout: str = "per_expert",
) -> dict[str, torch.Tensor]:
    """This rank's share of the full HF state dict (empty on non-owner ranks).

    Collective over the TP group (and, with ``expert_layout="fused"``, the expert-parallel
    group, whose first rank writes each layer's fused tensors whole): every rank of the
    world must call it.
    """
    coords = rank_coords()
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, tuple[Slot, dict[int, torch.Tensor]]] = {}
    for name, param, slot in _named_slots(chunks, arch, coords, prefix, expert_layout):
        if name == "output_layer.weight" and arch.tie_embeddings:
            continue  # the embedding owner writes the tied tensor
        local = param.detach().contiguous()
        if slot.kind.startswith("expert_fused"):
            block = local if slot.stacked else local.unsqueeze(0)
            parts = fused.setdefault(slot.hf_names[0], (slot, {}))[1]
            parts.update(zip(slot.experts, block.unbind(0), strict=True))
            continue
        if slot.kind == "replicated" or slot.kind.startswith("expert"):
            shards = [local]
        else:
            shards = tp_shards(local, coords)
        if is_owner(slot):
            out.update({k: v.clone() for k, v in unshard_to_hf(slot, shards, arch).items()})
    for hf_name in sorted(fused):  # the same names, in the same order, on each EP rank
        slot, parts = fused[hf_name]
        full = ep_gather(torch.stack([parts[e] for e in sorted(parts)]), coords)
        if is_owner(slot):
            out[hf_name] = fused_experts_for_file(full).clone()
    return out


@torch.no_grad()
def ep_gather(local: torch.Tensor, coords: RankCoords) -> torch.Tensor:
    """Every expert-parallel rank's ``local`` experts ``[E / EP, ...]`` concatenated in rank
    order (collective over the EP group; ``local`` at EP 1)."""
    if coords.ep_size == 1:
        return local
    from megatron.core import parallel_state as mps

    parts = [torch.empty_like(local) for _ in range(coords.ep_size)]
    dist.all_gather(parts, local.contiguous(), group=mps.get_expert_model_parallel_group())
    return torch.cat(parts, 0)


def save_hf_weights(
    chunks: list[torch.nn.Module],
    arch: DecoderModelConfig,
    out_dir: str | Path,
    *,
    prefix: str = "model.",
    extra: dict[str, torch.Tensor] | None = None,
    expert_layout: str = "per_expert",
) -> Path:
    """Write the model as HF safetensors shards + index into ``out_dir`` (collective).

    ``extra``: more HF tensors this rank writes with its share (a VLM's vision tower, on the
    rank that gathered it); each pipeline stage's owner writes its own layers.
    ``expert_layout``: how the routed experts are written (``hf_mapping.EXPERT_LAYOUTS``).
    """
    out_dir = Path(out_dir)
    state = gather_hf_state_dict(chunks, arch, prefix=prefix, expert_layout=expert_layout)
    state |= {k: v.detach().contiguous().cpu() for k, v in (extra or {}).items()}
    rank = dist.get_rank() if dist.is_initialized() else 0
    has_state: list[Any] = [bool(state)]
    if dist.is_initialized():
        has_state = [None] * dist.get_world_size()
        dist.all_gather_object(has_state, bool(state))
    writers = [r for r, has in enumerate(has_state) if has]
    if rank == 0:  # weights of an earlier export in this folder must not mix with these
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("model*.safetensors*"):
            old.unlink()
    if dist.is_initialized():
        dist.barrier()
    n = len(writers)
    fname = "model.safetensors"
    if n > 1 and state:
        fname = f"model-{writers.index(rank) + 1:05d}-of-{n:05d}.safetensors"
    if state:
        save_file(state, str(out_dir / fname), metadata={"format": "pt"})
    local = ({k: fname for k in state}, sum(t.numel() * t.element_size() for t in state.values()))
    gathered: list[Any] = [local]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    if rank == 0:
        weight_map: dict[str, str] = {}
        for m, _ in gathered:
            weight_map.update(m)
        expected = expected_hf_shapes(arch, prefix=prefix, expert_layout=expert_layout)
        missing = sorted(set(expected) - set(weight_map))
        if missing:
            raise RuntimeError(f"export is missing tensors: {missing}")
        if n > 1:
            index = {
                "metadata": {"total_size": sum(b for _, b in gathered)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            tmp = out_dir / "model.safetensors.index.json.tmp"
            tmp.write_text(json.dumps(index, indent=2))
            os.replace(tmp, out_dir / "model.safetensors.index.json")
    if dist.is_initialized():
        dist.barrier()
    return out_dir

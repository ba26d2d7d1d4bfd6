"""Reading and writing diffusers model directories, shared by the families' ``diffusers.py``.

A family supplies the tensor mapping (``TensorMap``: our name -> ``(diffusers name, to_ours,
to_diffusers)``) and the shapes a diffusers model of its config has; this module checks a
checkpoint against them, finds the safetensors files (single or sharded with an index), loads
each rank's tensor-parallel slice one tensor at a time, gathers the slices for export and
writes the directory as diffusers' ``save_pretrained`` does (shards under temporary names,
renamed at the end, so an interrupted export leaves no loadable half). Pickled ``.bin``
weights are never read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"

Convert = Callable[[torch.Tensor], torch.Tensor]
TensorMap = Mapping[str, tuple[str, Convert, Convert | None]]
"""Our name -> ``(diffusers name, to_ours, to_diffusers)``; ``to_diffusers`` None: a column
part of a diffusers tensor several of ours read (the parts are concatenated in map order on
export)."""


class CheckpointError(ValueError):
    """A checkpoint does not fit the architecture; the message lists every offending tensor.
    A family subclasses it with its name in ``family``."""

    family = "model"

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n  ".join(problems)
        super().__init__(
            f"{source}: {len(problems)} tensor problem(s) against the {self.family} config:"
            f"\n  {lines}\nFix: build the model from this checkpoint's config.json (read_config)."
        )


def shape_problems(
    shapes: Mapping[str, tuple[int, ...]], want: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """Every tensor of ``want`` missing from ``shapes``, every unexpected one and every shape
    that differs, one line each."""
    problems = [
        f"missing: {k} (expected shape {list(want[k])})" for k in sorted(set(want) - set(shapes))
    ]
    problems += [f"unexpected: {k}" for k in sorted(set(shapes) - set(want))]
    problems += [
        f"shape: {k} is {list(shapes[k])}, the config expects {list(want[k])}"
        for k in sorted(set(want) & set(shapes))
        if tuple(shapes[k]) != tuple(want[k])
    ]
    return problems


def from_diffusers(
    state_dict: Mapping[str, torch.Tensor], mapping: TensorMap
) -> dict[str, torch.Tensor]:
    """Our full (TP 1) state dict of a diffusers one (already checked against the shapes)."""
    return {ours: fn(state_dict[theirs]) for ours, (theirs, fn, _) in mapping.items()}


def to_diffusers(
    state_dict: Mapping[str, torch.Tensor], mapping: TensorMap, error: type[CheckpointError]
) -> dict[str, torch.Tensor]:
    """The diffusers state dict of our full (TP 1) one; ``error`` names every missing or
    unexpected tensor."""
    ours = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
    missing = sorted(set(mapping) - set(ours))
    unexpected = sorted(set(ours) - set(mapping))
    if missing or unexpected:
        raise error(
            "state dict",
            [f"missing: {k}" for k in missing] + [f"unexpected: {k}" for k in unexpected],
        )
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list[torch.Tensor]] = {}
    for name, (theirs, _, to_theirs) in mapping.items():
        if to_theirs is None:
            parts.setdefault(theirs, []).append(ours[name])
        else:
            out[theirs] = to_theirs(ours[name])
    return out | {theirs: torch.cat(p, dim=1) for theirs, p in parts.items()}


def weight_index(root: Path, class_name: str) -> dict[str, Path]:
    """Tensor name -> safetensors file of the diffusers model directory ``root``."""
    index = root / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / fname for name, fname in weight_map.items()}
    single = root / WEIGHTS_NAME
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return dict.fromkeys(f.keys(), single)
    pickled = sorted(p.name for p in root.glob("*.bin"))
    hint = f" (found {pickled}: pickled weights are not loaded)" if pickled else ""
    raise FileNotFoundError(
        f"{root}: no {WEIGHTS_NAME} or {INDEX_NAME}{hint}. Fix: point at a diffusers "
        f"{class_name} saved with safetensors."
    )


@contextmanager
def open_tensors(index: Mapping[str, Path]) -> Iterator[Any]:
    """``get(name) -> tensor`` and ``shapes() -> {name: shape}`` over the files of ``index``
    (each file opened once, closed on exit)."""
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(name: str) -> Any:
            file = index[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), "pt"))
            return handles[file]

        class Reader:
            @staticmethod
            def get(name: str) -> torch.Tensor:
                return handle(name).get_tensor(name)

            @staticmethod
            def shapes() -> dict[str, tuple[int, ...]]:
                return {k: tuple(handle(k).get_slice(k).get_shape()) for k in index}

        yield Reader()


def tp_coords() -> tuple[int, int]:
    """This rank's ``(tensor-parallel rank, size)``."""
    from megatron.core import parallel_state as mps

    return mps.get_tensor_model_parallel_rank(), mps.get_tensor_model_parallel_world_size()


def local_slice(full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of the full tensor of ``param`` (megatron's ``partition_dim``)."""
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(size, dim=param.partition_dim)[rank]


@torch.no_grad()
def load_full_state_dict(
    model: torch.nn.Module, full: Mapping[str, torch.Tensor], error: type[CheckpointError]
) -> None:
    """Copy our full (TP 1) state dict into ``model``, each rank taking its TP slice;
    ``error`` names every missing tensor."""
    rank, size = tp_coords()
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(full))
    if missing:
        raise error("state dict", [f"missing: {k}" for k in missing])
    for name, param in params.items():
        param.copy_(local_slice(full[name], param, rank, size))


@torch.no_grad()
def load_model_dir(
    model: torch.nn.Module,
    root: Path,
    class_name: str,
    mapping: TensorMap,
    check: Callable[[Mapping[str, tuple[int, ...]]], None],
    keep_fp32: dict[str, torch.Tensor] | None = None,
) -> int:
    """Load the diffusers model directory ``root`` into ``model`` (this rank's TP slice) after
    ``check(shapes)`` has seen every tensor's shape; returns the number of tensors loaded.

    ``keep_fp32``: filled with this rank's fp32 slice of every fp32 tensor loaded into a
    lower-precision parameter (by parameter name), for the optimizer's main weights."""
    index = weight_index(root, class_name)
    rank, size = tp_coords()
    params = dict(model.named_parameters())
    with open_tensors(index) as reader:
        check(reader.shapes())
        for name, param in params.items():
            theirs, to_ours, _ = mapping[name]
            full = to_ours(reader.get(theirs))
            local = local_slice(full, param, rank, size)
            param.copy_(local.to(param.dtype))
            if keep_fp32 is not None and local.dtype == torch.float32 != param.dtype:
                keep_fp32[name] = local.clone()  # not a view that would keep ``full`` alive
    return len(params)


@torch.no_grad()
def gather_state_dict(model: torch.nn.Module, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """The full (TP 1) state dict on the CPU, gathered over the TP group one tensor at a time
    (collective: every TP rank calls it). ``keep=False``: take part, keep nothing (``{}``)."""
    from longboat.core.megatron.hf_io import rank_coords, tp_shards

    coords = rank_coords()
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        local = param.detach()
        if coords.tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            local = torch.cat(tp_shards(local, coords), dim=param.partition_dim)
        if keep:
            out[name] = local.cpu()
    return out


def is_writer() -> bool:
    """Whether this rank writes an export (global rank 0)."""
    import torch.distributed as dist

    return (dist.get_rank() if dist.is_initialized() else 0) == 0


def write_model_dir(
    state: dict[str, torch.Tensor], config: dict[str, Any], out_dir: Path, limit: int
) -> None:
    """Write ``state`` (diffusers names) and ``config`` (``config.json``, with
    ``_class_name``) as a diffusers model directory, in shards of at most ``limit`` bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("diffusion_pytorch_model*"):
        old.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = state[name].contiguous()
        size += nbytes
    names = [WEIGHTS_NAME] if len(shards) == 1 else [
        f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        for i in range(len(shards))
    ]  # fmt: skip
    written: list[tuple[Path, Path]] = []
    for shard, fname in zip(shards, names):
        tmp = out_dir / (fname + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        written.append((tmp, out_dir / fname))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {k: fname for shard, fname in zip(shards, names) for k in shard},
        }
        tmp = out_dir / (INDEX_NAME + ".tmp")
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True))
        written.append((tmp, out_dir / INDEX_NAME))
    tmp = out_dir / "config.json.tmp"
    meta = {"_class_name": config["_class_name"], "_diffusers_version": diffusers_version()}
    tmp.write_text(json.dumps(meta | config, indent=2) + "\n")
    written.append((tmp, out_dir / "config.json"))
    for src, dst in written:
        os.replace(src, dst)


def save_model_dir(
    model: torch.nn.Module,
    out_dir: str | Path,
    export: Callable[[dict[str, torch.Tensor]], tuple[dict[str, torch.Tensor], dict[str, Any]]],
    max_shard_bytes: int,
) -> Path:
    """Write ``model`` as a diffusers model directory (collective over the TP group): the first
    data-parallel replica gathers our full state dict, the writer (global rank 0) turns it into
    ``(diffusers state dict, config.json dict with _class_name)`` by ``export`` and writes it
    (``write_model_dir``); every rank waits at a barrier."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mps

    out_dir = Path(out_dir)
    writes = is_writer()
    # Only the first data-parallel replica's TP group gathers (the others hold the same
    # weights), and only the writer keeps the gathered tensors.
    if mps.get_data_parallel_rank(with_context_parallel=True) == 0:
        full = gather_state_dict(model, keep=writes)
        if writes:
            state, config = export(full)
            write_model_dir(state, config, out_dir, max_shard_bytes)
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def diffusers_version() -> str:
    """The installed diffusers' version (the format is stable; a fixed one without it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("diffusers")
    except PackageNotFoundError:  # diffusers is the [prepare] extra
        return "0.35.0"

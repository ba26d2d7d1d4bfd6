"""diffusers ``WanTransformer3DModel`` checkpoints <-> ``WanModel``.

Our state dict at tensor-parallel size 1 (the *full* one) maps tensor by tensor onto
diffusers' names. Layout differences, undone on export:

- ``patch_embedding.weight`` is diffusers' ``Conv3d`` kernel ``[D, C, pt, ph, pw]`` flattened;
- the self-attention's q / k rows (``to_q``, ``to_k``, ``norm_q``, ``norm_k``) hold each head's
  even channels, then its odd ones (the rotation runs as a half-split one, ``block.py``);
- ``proj_out`` rows are ``(c, dt, dy, dx)`` (diffusers: ``(dt, dy, dx, c)``), so output tokens
  use the input tokens' layout.

``load_diffusers`` reads single-file or sharded safetensors (with the index), one tensor at a
time, each rank keeping its tensor-parallel slice (megatron's ``partition_dim`` of the
parameter). ``save_diffusers`` gathers the slices over the TP group and writes the weights and
``config.json`` as diffusers' ``save_pretrained`` does; ``WanTransformer3DModel.from_pretrained``
loads the directory. Pickled ``.bin`` weights are never read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from longboat.diffusion.models.wan.config import DIFFUSERS_CLASS, WanConfig, resolve_transformer_dir

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
# Tensors diffusers itself skips when loading a Wan transformer.
_IGNORED = re.compile(r"(^|\.)norm_added_q\.")

Convert = Callable[[torch.Tensor], torch.Tensor]


class WanCheckpointError(ValueError):
    """A checkpoint does not fit the architecture; the message lists every offending tensor."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n  ".join(problems)
        super().__init__(
            f"{source}: {len(problems)} tensor problem(s) against the Wan config:\n  {lines}\n"
            "Fix: build the model from this checkpoint's config.json (read_config)."
        )


# -- the mapping ------------------------------------------------------------------------------


def _even_odd(cfg: WanConfig) -> torch.Tensor:
    d = cfg.attention_head_dim
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _head_rows(perm: torch.Tensor, cfg: WanConfig) -> Convert:
    heads, d = cfg.num_attention_heads, cfg.attention_head_dim

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(heads, d, *x.shape[1:])[:, perm].reshape(x.shape).contiguous()

    return fn


def _proj_out_rows(cfg: WanConfig, to_ours: bool) -> Convert:
    pt, ph, pw = cfg.patch_size
    c = cfg.out_channels

    def fn(x: torch.Tensor) -> torch.Tensor:
        tail = x.shape[1:]
        if to_ours:  # (dt, dy, dx, c) -> (c, dt, dy, dx)
            y = x.reshape(pt, ph, pw, c, *tail).permute(3, 0, 1, 2, *range(4, 4 + len(tail)))
        else:
            y = x.reshape(c, pt, ph, pw, *tail).permute(1, 2, 3, 0, *range(4, 4 + len(tail)))
        return y.reshape(x.shape).contiguous()

    return fn


def tensor_map(cfg: WanConfig) -> dict[str, tuple[str, Convert, Convert]]:
    """Our name -> ``(diffusers name, to_ours, to_diffusers)`` for every tensor of the model."""
    same: Convert = lambda x: x  # noqa: E731
    d, c = cfg.hidden_size, cfg.in_channels
    out: dict[str, tuple[str, Convert, Convert]] = {
        "patch_embedding.weight": (
            "patch_embedding.weight",
            lambda x: x.reshape(d, -1),
            lambda x: x.reshape(d, c, *cfg.patch_size),
        ),
        "patch_embedding.bias": ("patch_embedding.bias", same, same),
        "scale_shift_table": ("scale_shift_table", same, same),
        "proj_out.weight": (
            "proj_out.weight",
            _proj_out_rows(cfg, True),
            _proj_out_rows(cfg, False),
        ),
        "proj_out.bias": ("proj_out.bias", _proj_out_rows(cfg, True), _proj_out_rows(cfg, False)),
    }
    for kind in ("weight", "bias"):
        for ours, theirs in (
            ("time_embedder.linear_1", "condition_embedder.time_embedder.linear_1"),
            ("time_embedder.linear_2", "condition_embedder.time_embedder.linear_2"),
            ("time_proj", "condition_embedder.time_proj"),
            ("text_embedder.linear_1", "condition_embedder.text_embedder.linear_1"),
            ("text_embedder.linear_2", "condition_embedder.text_embedder.linear_2"),
        ):
            out[f"{ours}.{kind}"] = (f"{theirs}.{kind}", same, same)
    perm = _even_odd(cfg)
    to_ours, to_theirs = _head_rows(perm, cfg), _head_rows(torch.argsort(perm), cfg)
    for i in range(cfg.num_layers):
        ours, theirs = f"blocks.{i}.", f"blocks.{i}."
        out[ours + "scale_shift_table"] = (theirs + "scale_shift_table", same, same)
        if cfg.cross_attn_norm:
            for kind in ("weight", "bias"):
                out[ours + f"cross_attn_norm.{kind}"] = (theirs + f"norm2.{kind}", same, same)
        for kind in ("weight", "bias"):
            out[ours + f"mlp.linear_fc1.{kind}"] = (theirs + f"ffn.net.0.proj.{kind}", same, same)
            out[ours + f"mlp.linear_fc2.{kind}"] = (theirs + f"ffn.net.2.{kind}", same, same)
        for attn, hf_attn in (("self_attention", "attn1"), ("cross_attention", "attn2")):
            rotated = attn == "self_attention"
            a, h = f"{ours}{attn}.", f"{theirs}{hf_attn}."
            for kind in ("weight", "bias"):
                for name, hf_name in (("linear_q", "to_q"), ("linear_k", "to_k")):
                    fns = (to_ours, to_theirs) if rotated else (same, same)
                    out[a + f"{name}.{kind}"] = (h + f"{hf_name}.{kind}", *fns)
                out[a + f"linear_v.{kind}"] = (h + f"to_v.{kind}", same, same)
                out[a + f"linear_proj.{kind}"] = (h + f"to_out.0.{kind}", same, same)
            for name, hf_name in (("q_norm", "norm_q"), ("k_norm", "norm_k")):
                fns = (to_ours, to_theirs) if rotated else (same, same)
                out[a + f"{name}.weight"] = (h + f"{hf_name}.weight", *fns)
    return out


def expected_diffusers_shapes(cfg: WanConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a diffusers ``WanTransformer3DModel`` of ``cfg`` with its shape."""
    d, f, t = cfg.hidden_size, cfg.ffn_dim, cfg.text_dim
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (d, cfg.in_channels, *cfg.patch_size),
        "patch_embedding.bias": (d,),
        "condition_embedder.time_embedder.linear_1.weight": (d, cfg.freq_dim),
        "condition_embedder.time_embedder.linear_1.bias": (d,),
        "condition_embedder.time_embedder.linear_2.weight": (d, d),
        "condition_embedder.time_embedder.linear_2.bias": (d,),
        "condition_embedder.time_proj.weight": (6 * d, d),
        "condition_embedder.time_proj.bias": (6 * d,),
        "condition_embedder.text_embedder.linear_1.weight": (d, t),
        "condition_embedder.text_embedder.linear_1.bias": (d,),
        "condition_embedder.text_embedder.linear_2.weight": (d, d),
        "condition_embedder.text_embedder.linear_2.bias": (d,),
        "proj_out.weight": (cfg.out_patch_dim, d),
        "proj_out.bias": (cfg.out_patch_dim,),
        "scale_shift_table": (1, 2, d),
    }
    for i in range(cfg.num_layers):
        b = f"blocks.{i}."
        shapes[b + "scale_shift_table"] = (1, 6, d)
        if cfg.cross_attn_norm:
            shapes |= {b + "norm2.weight": (d,), b + "norm2.bias": (d,)}
        shapes |= {
            b + "ffn.net.0.proj.weight": (f, d),
            b + "ffn.net.0.proj.bias": (f,),
            b + "ffn.net.2.weight": (d, f),
            b + "ffn.net.2.bias": (d,),
        }
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                shapes |= {f"{b}{attn}.{proj}.weight": (d, d), f"{b}{attn}.{proj}.bias": (d,)}
            shapes |= {f"{b}{attn}.norm_q.weight": (d,), f"{b}{attn}.norm_k.weight": (d,)}
    return shapes


def from_diffusers_state_dict(
    state_dict: Mapping[str, torch.Tensor], cfg: WanConfig
) -> dict[str, torch.Tensor]:
    """Our full (TP 1) state dict from a diffusers one; ``WanCheckpointError`` names every
    missing, unexpected or mis-shaped tensor."""
    _check({k: tuple(v.shape) for k, v in state_dict.items()}, cfg, "diffusers state dict")
    return {ours: fn(state_dict[theirs]) for ours, (theirs, fn, _) in tensor_map(cfg).items()}


def to_diffusers_state_dict(
    state_dict: Mapping[str, torch.Tensor], cfg: WanConfig
) -> dict[str, torch.Tensor]:
    """The diffusers state dict of our full (TP 1) one."""
    mapping = tensor_map(cfg)
    ours = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
    missing = sorted(set(mapping) - set(ours))
    unexpected = sorted(set(ours) - set(mapping))
    if missing or unexpected:
        raise WanCheckpointError(
            "state dict",
            [f"missing: {k}" for k in missing] + [f"unexpected: {k}" for k in unexpected],
        )
    return {theirs: fn(ours[name]) for name, (theirs, _, fn) in mapping.items()}


def _check(shapes: Mapping[str, tuple[int, ...]], cfg: WanConfig, source: str) -> None:
    want = expected_diffusers_shapes(cfg)
    present = {k: v for k, v in shapes.items() if not _IGNORED.search(k)}
    problems = [
        f"missing: {k} (expected shape {list(want[k])})" for k in sorted(set(want) - set(present))
    ]
    problems += [f"unexpected: {k}" for k in sorted(set(present) - set(want))]
    problems += [
        f"shape: {k} is {list(present[k])}, the config expects {list(want[k])}"
        for k in sorted(set(want) & set(present))
        if tuple(present[k]) != want[k]
    ]
    if problems:
        raise WanCheckpointError(source, problems)


# -- tensor parallelism -----------------------------------------------------------------------


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as mps

    return mps.get_tensor_model_parallel_rank(), mps.get_tensor_model_parallel_world_size()


def _local_slice(full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(size, dim=param.partition_dim)[rank]


@torch.no_grad()
def load_state_dict(model: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy our full (TP 1) state dict into ``model``, each rank taking its TP slice."""
    rank, size = _tp()
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(full))
    if missing:
        raise WanCheckpointError("state dict", [f"missing: {k}" for k in missing])
    for name, param in params.items():
        param.copy_(_local_slice(full[name], param, rank, size))


@torch.no_grad()
def gather_state_dict(model: torch.nn.Module, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """Our full (TP 1) state dict on the CPU, gathered over the TP group one tensor at a time
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


# -- files ------------------------------------------------------------------------------------


def diffusers_weight_index(path: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a diffusers model directory (single or sharded)."""
    root = resolve_transformer_dir(path)
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
        "WanTransformer3DModel saved with safetensors."
    )


@torch.no_grad()
def load_diffusers(model: torch.nn.Module, cfg: WanConfig, path: str | Path) -> int:
    """Load a diffusers ``WanTransformer3DModel`` directory (``model.init_from``) into
    ``model`` (this rank's TP slice); returns the number of tensors loaded.

    Every missing, unexpected or mis-shaped tensor is reported before any is copied.
    """
    index = diffusers_weight_index(path)
    rank, size = _tp()
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(name: str) -> Any:
            file = index[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), "pt"))
            return handles[file]

        shapes = {k: tuple(handle(k).get_slice(k).get_shape()) for k in index}
        _check(shapes, cfg, str(path))
        params = dict(model.named_parameters())
        mapping = tensor_map(cfg)
        for name, param in params.items():
            theirs, to_ours, _ = mapping[name]
            full = to_ours(handle(theirs).get_tensor(theirs))
            param.copy_(_local_slice(full, param, rank, size).to(param.dtype))
    return len(params)


def save_diffusers(
    model: torch.nn.Module,
    cfg: WanConfig,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write ``model`` as a diffusers ``WanTransformer3DModel`` directory (collective over the
    TP group). Rank 0 writes ``config.json`` and the weights, in shards of at most
    ``max_shard_bytes`` with an index when they do not fit one file; files are written under
    temporary names and renamed at the end, so an interrupted export leaves no loadable half.
    """
    from megatron.core import parallel_state as mps

    out_dir = Path(out_dir)
    writes = (dist.get_rank() if dist.is_initialized() else 0) == 0
    # Only the first data-parallel replica's TP group gathers (the others hold the same
    # weights), and only the writer keeps the gathered tensors.
    if mps.get_data_parallel_rank(with_context_parallel=True) == 0:
        full = gather_state_dict(model, keep=writes)
        if writes:
            _write(to_diffusers_state_dict(full, cfg), cfg, out_dir, max_shard_bytes)
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def _write(state: dict[str, torch.Tensor], cfg: WanConfig, out_dir: Path, limit: int) -> None:
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
    config = {"_class_name": DIFFUSERS_CLASS, "_diffusers_version": _diffusers_version()}
    tmp = out_dir / "config.json.tmp"
    tmp.write_text(json.dumps(config | cfg.to_diffusers(), indent=2) + "\n")
    written.append((tmp, out_dir / "config.json"))
    for src, dst in written:
        os.replace(src, dst)


def _diffusers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("diffusers")
    except PackageNotFoundError:  # diffusers is the [prepare] extra; the format is stable
        return "0.35.0"

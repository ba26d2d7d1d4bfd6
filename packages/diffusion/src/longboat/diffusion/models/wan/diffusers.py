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
loads the directory (``longboat.diffusion.models.diffusers_io``). Pickled ``.bin`` weights are
never read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from longboat.diffusion.models import diffusers_io
from longboat.diffusion.models.diffusers_io import (
    INDEX_NAME,
    WEIGHTS_NAME,
    Convert,
    gather_state_dict,
)
from longboat.diffusion.models.wan.config import DIFFUSERS_CLASS, WanConfig, resolve_transformer_dir

# Tensors diffusers itself skips when loading a Wan transformer.
_IGNORED = re.compile(r"(^|\.)norm_added_q\.")


class WanCheckpointError(diffusers_io.CheckpointError):
    """A checkpoint does not fit the architecture; the message lists every offending tensor."""

    family = "Wan"


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
    return diffusers_io.from_diffusers(state_dict, tensor_map(cfg))


def to_diffusers_state_dict(
    state_dict: Mapping[str, torch.Tensor], cfg: WanConfig
) -> dict[str, torch.Tensor]:
    """The diffusers state dict of our full (TP 1) one."""
    return diffusers_io.to_diffusers(state_dict, tensor_map(cfg), WanCheckpointError)


def _check(shapes: Mapping[str, tuple[int, ...]], cfg: WanConfig, source: str) -> None:
    present = {k: v for k, v in shapes.items() if not _IGNORED.search(k)}
    problems = diffusers_io.shape_problems(present, expected_diffusers_shapes(cfg))
    if problems:
        raise WanCheckpointError(source, problems)


# -- tensor parallelism and files -------------------------------------------------------------


def load_state_dict(model: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy our full (TP 1) state dict into ``model``, each rank taking its TP slice."""
    diffusers_io.load_full_state_dict(model, full, WanCheckpointError)


def diffusers_weight_index(path: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a diffusers model directory (single or sharded)."""
    return diffusers_io.weight_index(resolve_transformer_dir(path), DIFFUSERS_CLASS)


def load_diffusers(
    model: torch.nn.Module,
    cfg: WanConfig,
    path: str | Path,
    *,
    keep_fp32: dict[str, torch.Tensor] | None = None,
) -> int:
    """Load a diffusers ``WanTransformer3DModel`` directory (``model.init_from``) into
    ``model`` (this rank's TP slice); returns the number of tensors loaded.

    Every missing, unexpected or mis-shaped tensor is reported before any is copied.
    """
    root = resolve_transformer_dir(path)
    return diffusers_io.load_model_dir(
        model,
        root,
        DIFFUSERS_CLASS,
        tensor_map(cfg),
        lambda s: _check(s, cfg, str(path)),
        keep_fp32=keep_fp32,
    )


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

    def export(full: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        config = {"_class_name": DIFFUSERS_CLASS} | cfg.to_diffusers()
        return to_diffusers_state_dict(full, cfg), config

    return diffusers_io.save_model_dir(model, out_dir, export, max_shard_bytes)


__all__ = [
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "Convert",
    "WanCheckpointError",
    "diffusers_weight_index",
    "expected_diffusers_shapes",
    "from_diffusers_state_dict",
    "gather_state_dict",
    "load_diffusers",
    "load_state_dict",
    "save_diffusers",
    "tensor_map",
    "to_diffusers_state_dict",
]

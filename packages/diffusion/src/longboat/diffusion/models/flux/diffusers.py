"""diffusers ``FluxTransformer2DModel`` checkpoints <-> ``FluxModel``.

Our state dict at tensor-parallel size 1 (the *full* one) maps onto diffusers' names tensor by
tensor, with two layout differences, undone on export:

- the q / k rows of every attention (``to_q``, ``to_k``, ``add_q_proj``, ``add_k_proj``) and
  the qk-norm weights hold each head's even channels, then its odd ones (the rotation runs as
  a half-split one, ``block.py``);
- a single-stream block's ``proj_out`` over ``cat(attention, mlp)`` is split by columns into
  ``linear_proj`` (the first ``hidden_size`` columns and the bias) and ``linear_fc2`` (the rest).

``load_diffusers`` reads single-file or sharded safetensors, one tensor at a time, each rank
keeping its tensor-parallel slice; ``save_diffusers`` gathers the slices over the TP group and
writes a directory ``FluxTransformer2DModel.from_pretrained`` loads
(``longboat.diffusion.models.diffusers_io``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from longboat.diffusion.models import diffusers_io
from longboat.diffusion.models.diffusers_io import Convert
from longboat.diffusion.models.flux.config import (
    DIFFUSERS_CLASS,
    FluxConfig,
    resolve_transformer_dir,
)

_SAME: Convert = lambda x: x  # noqa: E731


class FluxCheckpointError(diffusers_io.CheckpointError):
    """A checkpoint does not fit the architecture; the message lists every offending tensor."""

    family = "FLUX"


# -- the mapping ------------------------------------------------------------------------------


def _head_rows(cfg: FluxConfig, to_ours: bool) -> Convert:
    """Per-head channel order (even, odd) <-> diffusers' interleaved one, on dim 0."""
    d = cfg.attention_head_dim
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    if not to_ours:
        perm = torch.argsort(perm)

    def fn(x: torch.Tensor) -> torch.Tensor:
        heads = x.shape[0] // d
        return x.reshape(heads, d, *x.shape[1:])[:, perm].reshape(x.shape).contiguous()

    return fn


def tensor_map(cfg: FluxConfig) -> dict[str, tuple[str, Convert, Convert | None]]:
    """Our name -> ``(diffusers name, to_ours, to_diffusers)`` for every tensor of the model.
    ``to_diffusers`` None: a column part of a diffusers tensor several of ours read (a
    single-stream ``proj_out``; parts concatenated in map order on export)."""
    out: dict[str, tuple[str, Convert, Convert | None]] = {}
    rows = (_head_rows(cfg, True), _head_rows(cfg, False))
    same = (_SAME, _SAME)

    def linear(ours: str, theirs: str, fns: tuple[Convert, Convert] = same) -> None:
        out[f"{ours}.weight"] = (f"{theirs}.weight", *fns)
        out[f"{ours}.bias"] = (f"{theirs}.bias", *fns)

    linear("x_embedder", "x_embedder")
    linear("context_embedder", "context_embedder")
    embedders = [("time_embedder", "timestep_embedder"), ("pooled_embedder", "text_embedder")]
    if cfg.guidance_embeds:
        embedders.append(("guidance_embedder", "guidance_embedder"))
    for ours, theirs in embedders:
        for k in ("linear_1", "linear_2"):
            linear(f"{ours}.{k}", f"time_text_embed.{theirs}.{k}")
    linear("norm_out", "norm_out.linear")
    linear("proj_out", "proj_out")

    def qkv(ours: str, q: str, k: str, v: str, qn: str, kn: str) -> None:
        linear(f"{ours}.linear_q", q, rows)
        linear(f"{ours}.linear_k", k, rows)
        linear(f"{ours}.linear_v", v)
        out[f"{ours}.q_norm.weight"] = (f"{qn}.weight", *rows)
        out[f"{ours}.k_norm.weight"] = (f"{kn}.weight", *rows)

    for i in range(cfg.num_layers):
        o, t = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        linear(o + "img_mod", t + "norm1.linear")
        linear(o + "txt_mod", t + "norm1_context.linear")
        a = t + "attn."
        qkv(o + "img_attn", a + "to_q", a + "to_k", a + "to_v", a + "norm_q", a + "norm_k")
        qkv(
            o + "txt_attn", a + "add_q_proj", a + "add_k_proj", a + "add_v_proj",
            a + "norm_added_q", a + "norm_added_k",
        )  # fmt: skip
        linear(o + "img_proj", a + "to_out.0")
        linear(o + "txt_proj", a + "to_add_out")
        for ours, theirs in (("img_mlp", "ff"), ("txt_mlp", "ff_context")):
            linear(f"{o}{ours}.linear_fc1", f"{t}{theirs}.net.0.proj")
            linear(f"{o}{ours}.linear_fc2", f"{t}{theirs}.net.2")
    d = cfg.hidden_size
    for i in range(cfg.num_single_layers):
        o, t = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        linear(o + "mod", t + "norm.linear")
        a = t + "attn."
        qkv(o + "attn", a + "to_q", a + "to_k", a + "to_v", a + "norm_q", a + "norm_k")
        linear(o + "linear_fc1", t + "proj_mlp")
        proj = t + "proj_out.weight"
        out[o + "linear_proj.weight"] = (proj, lambda x: x[:, :d].contiguous(), None)
        out[o + "linear_proj.bias"] = (t + "proj_out.bias", _SAME, _SAME)
        out[o + "linear_fc2.weight"] = (proj, lambda x: x[:, d:].contiguous(), None)
    return out


def expected_diffusers_shapes(cfg: FluxConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a diffusers ``FluxTransformer2DModel`` of ``cfg`` with its shape."""
    d, f, hd = cfg.hidden_size, cfg.ffn_dim, cfg.attention_head_dim
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, d_in: int, d_out: int) -> None:
        shapes[f"{name}.weight"] = (d_out, d_in)
        shapes[f"{name}.bias"] = (d_out,)

    linear("x_embedder", cfg.in_channels, d)
    linear("context_embedder", cfg.joint_attention_dim, d)
    embed = {"timestep_embedder": 256, "text_embedder": cfg.pooled_projection_dim}
    if cfg.guidance_embeds:
        embed["guidance_embedder"] = 256
    for name, d_in in embed.items():
        linear(f"time_text_embed.{name}.linear_1", d_in, d)
        linear(f"time_text_embed.{name}.linear_2", d, d)
    linear("norm_out.linear", d, 2 * d)
    linear("proj_out", d, cfg.token_out_channels)
    for i in range(cfg.num_layers):
        t = f"transformer_blocks.{i}."
        linear(t + "norm1.linear", d, 6 * d)
        linear(t + "norm1_context.linear", d, 6 * d)
        for proj in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                     "add_v_proj", "to_add_out"):  # fmt: skip
            linear(f"{t}attn.{proj}", d, d)
        for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            shapes[f"{t}attn.{norm}.weight"] = (hd,)
        for ff in ("ff", "ff_context"):
            linear(f"{t}{ff}.net.0.proj", d, f)
            linear(f"{t}{ff}.net.2", f, d)
    for i in range(cfg.num_single_layers):
        t = f"single_transformer_blocks.{i}."
        linear(t + "norm.linear", d, 3 * d)
        for proj in ("to_q", "to_k", "to_v"):
            linear(f"{t}attn.{proj}", d, d)
        for norm in ("norm_q", "norm_k"):
            shapes[f"{t}attn.{norm}.weight"] = (hd,)
        linear(t + "proj_mlp", d, f)
        linear(t + "proj_out", d + f, d)
    return shapes


def _check(shapes: Mapping[str, tuple[int, ...]], cfg: FluxConfig, source: str) -> None:
    problems = diffusers_io.shape_problems(shapes, expected_diffusers_shapes(cfg))
    if problems:
        raise FluxCheckpointError(source, problems)


def from_diffusers_state_dict(
    state_dict: Mapping[str, torch.Tensor], cfg: FluxConfig
) -> dict[str, torch.Tensor]:
    """Our full (TP 1) state dict from a diffusers one; ``FluxCheckpointError`` names every
    missing, unexpected or mis-shaped tensor."""
    _check({k: tuple(v.shape) for k, v in state_dict.items()}, cfg, "diffusers state dict")
    return diffusers_io.from_diffusers(state_dict, tensor_map(cfg))


def to_diffusers_state_dict(
    state_dict: Mapping[str, torch.Tensor], cfg: FluxConfig
) -> dict[str, torch.Tensor]:
    """The diffusers state dict of our full (TP 1) one (a single-stream ``proj_out`` is
    its ``linear_proj`` and ``linear_fc2`` columns concatenated)."""
    return diffusers_io.to_diffusers(state_dict, tensor_map(cfg), FluxCheckpointError)


# -- tensor parallelism and files -------------------------------------------------------------


def load_state_dict(model: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy our full (TP 1) state dict into ``model``, each rank taking its TP slice."""
    diffusers_io.load_full_state_dict(model, full, FluxCheckpointError)


def load_diffusers(
    model: torch.nn.Module,
    cfg: FluxConfig,
    path: str | Path,
    *,
    keep_fp32: dict[str, torch.Tensor] | None = None,
) -> int:
    """Load a diffusers ``FluxTransformer2DModel`` directory (``model.init_from``) into
    ``model`` (this rank's TP slice); returns the number of tensors loaded. Every missing,
    unexpected or mis-shaped tensor is reported before any is copied."""
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
    cfg: FluxConfig,
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write ``model`` as a diffusers ``FluxTransformer2DModel`` directory (collective over
    the TP group; rank 0 writes, see ``diffusers_io.save_model_dir``)."""

    def export(full: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        config = {"_class_name": DIFFUSERS_CLASS} | cfg.to_diffusers()
        return to_diffusers_state_dict(full, cfg), config

    return diffusers_io.save_model_dir(model, out_dir, export, max_shard_bytes)

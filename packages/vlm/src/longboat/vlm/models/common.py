"""What the VLM family modules share: reading a ``config.json``, checking a checkpoint's
architecture against the built one, building the decoder chunk (and a Qwen tower) of this
rank, reading and writing the vision tower's tensors, and looking flavors up.

Nothing here imports torch or megatron until called, so config modules may use it. The
family-specific parts (config fields, tensor names and layouts, position ids) stay in
each family's ``model.py``; these helpers take them as arguments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longboat.core.config.errors import ConfigError

if TYPE_CHECKING:  # torch is imported when a model is built, not to read a config
    import torch

RECOMPUTE_COMPONENTS = ("vision", "language")
"""What ``train.recompute_components`` may name: each ViT block and / or each decoder
layer."""

_FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}


def read_config_json(source: str | Path | dict[str, Any], what: str) -> tuple[dict[str, Any], str]:
    """``(config dict, where it came from)`` of a directory's ``config.json`` or a parsed
    dict; ``what`` names the expected checkpoint in the error's fix."""
    if isinstance(source, dict):
        return source, "config.json"
    path = Path(source) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found", fix=f"point at a {what} directory")
    return json.loads(path.read_text()), str(path)


def check_model_type(hf: Mapping[str, Any], where: str, model_type: str, fix: str) -> None:
    """Refuse a ``config.json`` whose ``model_type`` is not ``model_type``."""
    if hf.get("model_type") != model_type:
        raise ConfigError(
            f"{where}: model_type={hf.get('model_type')!r} is not {model_type!r}", fix=fix
        )


def architecture_diff(
    want: Mapping[str, Any], found: Mapping[str, Any], prefix: str = "model"
) -> list[str]:
    """One line per key (dotted, nested dicts descended) where ``found`` differs from ``want``."""
    out = []
    for key in sorted(set(want) | set(found)):
        a, b = want.get(key), found.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += architecture_diff(a, b, f"{prefix}.{key}")
        elif a != b:
            out.append(f"{prefix}.{key}={a!r} but the checkpoint has {b!r}")
    return out


def check_checkpoint_architecture(
    want: Mapping[str, Any], found: Mapping[str, Any], hf_dir: str | Path
) -> None:
    """Refuse a checkpoint whose config (``found``) describes another model than the built
    one (``want``), naming every difference."""
    if found != want:
        raise ConfigError(
            f"{hf_dir}/config.json describes a different model than the one built: "
            + "; ".join(architecture_diff(want, found)),
            fix="build the model from read_hf_config(<dir>) (model.init_from reads it)",
        )


def params_dtype(precision: str) -> torch.dtype:
    """The parameter dtype of ``precision`` (``fp32``, ``bf16`` or ``fp16``)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def check_recompute(recompute: Iterable[str]) -> None:
    """Refuse recompute components other than ``vision`` / ``language``."""
    unknown = sorted(set(recompute) - set(RECOMPUTE_COMPONENTS))
    if unknown:
        raise ConfigError(
            f"unknown component(s) {unknown}",
            key="train.recompute_components",
            fix="use vision and / or language",
        )


def build_decoder_stage(
    language: Any,
    *,
    kernels: Any,
    precision: str,
    device_type: str,
    recompute: Iterable[str],
    **extra: Any,
) -> Any:
    """This rank's decoder (one pipeline stage), every layer recomputed when ``recompute``
    names ``language``; ``extra`` goes to core's ``build_decoder``. Interleaved virtual
    pipeline stages are refused."""
    from longboat.core.megatron.decoder_build import build_decoder

    chunks = build_decoder(
        language,
        kernels=kernels,
        precision=precision,
        device_type=device_type,
        **extra,
        **(_FULL_RECOMPUTE if "language" in recompute else {}),
    )
    if len(chunks) != 1:
        raise ConfigError(
            "interleaved virtual pipeline stages are not supported by longboat-vlm",
            key="parallel.virtual_pipeline_parallel",
            value=len(chunks),
            fix="set it to null (plain 1F1B over parallel.pipeline_parallel stages)",
        )
    return chunks[0]


def build_split_tower(
    tower_cls: Callable[..., torch.nn.Module],
    vision_cfg: Any,
    *,
    first_stage: bool,
    split: Any,
    precision: str,
    device_type: str,
    kernels: Any,
    recompute: Iterable[str],
) -> torch.nn.Module | None:
    """A Qwen-style tower on the first pipeline stage (``None`` on later ones): sharded over
    the decoder's TP group, or unsharded and replicated when ``split`` (a
    ``vision_parallel.vision_split``) is set."""
    import torch

    from longboat.vlm.models.vision_parallel import replicate_tower

    if not first_stage:
        return None
    groups = split.tower_groups if split is not None else None
    vision = tower_cls(
        vision_cfg, params_dtype=params_dtype(precision), kernels=kernels, pg_collection=groups
    )
    vision.recompute = "vision" in recompute
    vision = vision.to(torch.device(device_type))
    if split is not None:
        replicate_tower(vision, split)
    return vision


DECODER_PREFIXES = ("model.language_model.", "model.")
"""Where a Qwen-VL checkpoint keeps the decoder: transformers 5's in-memory names (and the
released Qwen3-VL files'), then the layout of released Qwen2.5-VL files and older
conversions."""


def decoder_prefix(names: Iterable[str]) -> str:
    """The first of ``DECODER_PREFIXES`` under which ``names`` hold the token embedding
    (``model.`` when none does)."""
    names = set(names)
    return next((p for p in DECODER_PREFIXES if f"{p}embed_tokens.weight" in names), "model.")


def read_tensors(index: Mapping[str, Path], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's weight index whose name starts with one of ``prefixes``
    (each file opened once)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in index.items():
        if name.startswith(prefixes):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), "pt") as f:
            out.update({name: f.get_tensor(name) for name in names})
    return out


def tower_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s tensors, detached, without transformer-engine ``_extra_state`` entries."""
    import torch

    return {
        k: v.detach()
        for k, v in module.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }


def load_split_tower(
    model: Any,
    ours: dict[str, torch.Tensor],
    hf_dir: str | Path,
    shard: Callable[[dict[str, torch.Tensor], int, int], dict[str, torch.Tensor]],
) -> int:
    """Load our unsharded tower state dict ``ours`` into ``model.vision`` (cut for this
    tensor-parallel rank by ``shard`` unless the tower is unsharded); refuses a state dict
    that leaves a tensor unset. Returns the number of tensors given."""
    from longboat.core.megatron.hf_io import rank_coords

    coords = rank_coords()
    if coords.tp_size > 1 and model.vision_split is None:  # else the tower is unsharded
        ours = shard(ours, coords.tp_rank, coords.tp_size)
    model.vision.load_state_dict(ours, strict=False)
    missing = [
        k for k in model.vision.state_dict() if k not in ours and not k.endswith("_extra_state")
    ]
    if missing:
        raise ConfigError(f"{hf_dir}: the vision tower has no tensors for {missing}")
    return len(ours)


def gather_split_tower(
    model: Any, unshard: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The unsharded tower state dict of ``model.vision`` (collective over the TP group
    unless the tower is unsharded, then this rank's replica)."""
    from longboat.core.megatron.hf_io import rank_coords, tp_shards

    local = tower_state(model.vision)
    if model.vision_split is not None:  # unsharded: this rank's replica is the tower
        return local
    coords = rank_coords()
    per_rank = [dict(zip(local, parts, strict=True)) for parts in
                zip(*(tp_shards(v, coords) for v in local.values()), strict=True)]  # fmt: skip
    return unshard(per_rank)


def tower_hf_state(model: Any, vision_cfg: Any, vision_hf: Any, prefix: str) -> dict[str, Any]:
    """The split tower of ``model`` (with its mergers) as full tensors under their HF names
    after ``prefix`` (``vision_hf``: ``unshard_vision_state_dict``, ``vision_to_hf``);
    collective over the TP group like ``save_decoder_and_tower``, empty where the model has
    no tower (a later pipeline stage)."""
    if model.vision is None:
        return {}
    full = gather_split_tower(model, vision_hf.unshard_vision_state_dict)
    return vision_hf.vision_to_hf(full, vision_cfg, prefix=prefix)


def load_decoder_and_tower(
    model: Any, cfg: Any, hf_dir: str | Path, vision_hf: Any, *, expert_layout: str = "per_expert"
) -> int:
    """Read a checkpoint holding the decoder under ``model.*`` and the tower under
    ``vision_hf.HF_PREFIXES`` into this rank's model (the tower on the stage that has it);
    returns the number of tensors read. ``vision_hf`` is the family's conversion module
    (``vision_from_hf``, ``shard_vision_state_dict``); ``expert_layout``: how an MoE decoder's
    experts are stored (core's ``hf_mapping.EXPERT_LAYOUTS``). A tower that does not fit
    raises ``ConfigError`` naming every missing, unexpected and wrongly shaped tensor."""
    from longboat.core.megatron.hf_io import hf_weight_index, load_hf_weights
    from longboat.vlm.models.vit_state import VisionStateDictError

    index = hf_weight_index(hf_dir)
    prefixes = vision_hf.HF_PREFIXES
    n = load_hf_weights(
        [model.language], cfg.language, hf_dir, prefix=decoder_prefix(index),
        other_prefixes=prefixes, expert_layout=expert_layout,
    )  # fmt: skip
    if model.vision is None:  # a later pipeline stage: the tower lives on the first
        return n
    try:
        ours = vision_hf.vision_from_hf(read_tensors(index, prefixes), cfg.vision)
    except VisionStateDictError as exc:
        raise ConfigError(f"{hf_dir}: {exc}") from None
    return n + load_split_tower(model, ours, hf_dir, vision_hf.shard_vision_state_dict)


def save_decoder_and_tower[C](
    model: Any,
    cfg: C,
    out_dir: str | Path,
    vision_hf: Any,
    to_hf_config: Callable[[C], Any],
    *,
    language_prefix: str,
    visual_prefix: str,
    expert_layout: str = "per_expert",
) -> Path:
    """Write ``config.json`` + the safetensors weights in the layout ``transformers`` loads:
    the decoder under ``language_prefix``, the tower under ``visual_prefix`` (``vision_hf``:
    ``unshard_vision_state_dict``, ``vision_to_hf``). Collective over the world:
    tensor-parallel shards are gathered; rank 0 writes the tower and the first stage's
    layers, with pipeline parallelism each later stage's owner writes its own layers to a
    shard listed in ``model.safetensors.index.json``. ``expert_layout`` as in
    ``load_decoder_and_tower``."""
    import torch.distributed as dist

    from longboat.core.megatron.hf_io import save_hf_weights

    out_dir = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    visual: dict[str, torch.Tensor] = {}
    if model.vision is not None:  # the first pipeline stage: gather the tower's TP shards
        full = gather_split_tower(model, vision_hf.unshard_vision_state_dict)
        if rank == 0:
            visual = vision_hf.vision_to_hf(full, cfg.vision, prefix=visual_prefix)
    save_hf_weights(
        [model.language], cfg.language, out_dir, prefix=language_prefix, extra=visual,
        expert_layout=expert_layout,
    )  # fmt: skip
    write_hf_config(to_hf_config, cfg, out_dir, rank)
    return out_dir


def write_hf_config[C](to_hf_config: Callable[[C], Any], cfg: C, out_dir: Path, rank: int) -> None:
    """Rank 0 writes ``to_hf_config(cfg)`` (float32 weights) to ``out_dir``; every rank then
    waits for it (a barrier when distributed)."""
    import torch.distributed as dist

    if rank == 0:
        hf_config = to_hf_config(cfg)
        hf_config.dtype = "float32"
        hf_config.save_pretrained(out_dir)
    if dist.is_initialized():
        dist.barrier()


def language_from_section(raw: Mapping[str, Any], base: Any) -> Any:
    """A composed family's decoder from a run's ``model.language`` section: ``name`` +
    ``flavor`` pick a core decoder flavor (``decoder_flavors``; neither: ``base``, a
    ``DecoderModelConfig``), the other keys override its fields."""
    import dataclasses

    from longboat.core.megatron.decoder_config import DecoderModelConfig
    from longboat.core.megatron.decoder_flavors import decoder_flavor, decoder_names

    raw = dict(raw)
    name = raw.pop("name", None)
    flavor = raw.pop("flavor", None)
    if name is None and flavor is None:
        cfg = dataclasses.replace(base)
    else:
        name = name or base.name
        if name not in decoder_names():
            raise ConfigError(
                f"model.language.name={name!r}: unknown decoder family",
                fix=f"use one of {decoder_names()} (model/llm@model.language=<option>)",
            )
        cfg = decoder_flavor(name, flavor or "tiny", key="model.language")
    names = {f.name for f in dataclasses.fields(DecoderModelConfig)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(
            f"{', '.join(f'model.language.{k}' for k in unknown)}: unknown key(s)",
            fix=f"decoder configs take {sorted(names)}",
        )
    if "mrope_section" in raw and raw["mrope_section"] is not None:
        raw["mrope_section"] = list(raw["mrope_section"])
    return dataclasses.replace(cfg, **raw)


def pick_flavor[C](flavors: Mapping[str, C], name: str, family: str) -> C:
    """Flavor ``name`` of ``flavors``; a ``ConfigError`` naming ``model.flavor`` otherwise."""
    if name not in flavors:
        raise ConfigError(
            f"model.flavor={name!r}: {family} has flavors {sorted(flavors)}",
            fix="pick one of them",
        )
    return flavors[name]

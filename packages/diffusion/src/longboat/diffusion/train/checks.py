"""Every check of a diffusion run's config, before anything heavy is built.

``check_experiment(cfg)`` raises one ``ConfigError`` naming every bad key and its fix: the
model (family, flavor, ``init_from`` directory, ``overrides`` field names and values), the
objective, the data (its own keys, and against the model: latent channels, text width, the
patch dividing every latent shape), the parallel layout against the model (heads divisible by
``tp * cp``), and the run settings. The stack runs it at compose time (``validate_diffusion``,
so ``longboat-diffusion train`` exits 2 before any process group exists) and the run again
when built from a config directly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError, ProblemCollector
from longboat.core.config.suggest import did_you_mean

__all__ = [
    "check_experiment",
    "model_config",
    "model_family",
    "recompute_fields",
    "validate_diffusion",
]

DATA_KINDS = ("latents", "synthetic_squares")
"""``data.name`` values a training run reads."""
CPU_PRECISIONS = ("fp32", "bf16")


def model_family(model: Any) -> Any:
    """The run's ``DiffusionFamily``: the checkpoint's (its ``_class_name``) with
    ``model.init_from``, else ``model.name``'s."""
    from longboat.diffusion.models.registry import family_of_diffusers_dir, get_family

    if model.init_from:
        return family_of_diffusers_dir(model.init_from)
    return get_family(model.name)


_RUN_KEYS = ("recompute_blocks", "recompute_attention")
"""Family config fields set from ``model.<key>``, not architecture overrides."""


def _with_overrides(base: Any, overrides: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(base)}
    p = ProblemCollector()
    changes = {}
    for key, value in overrides.items():
        if key not in fields or key in _RUN_KEYS:
            names = [n for n in fields if n not in _RUN_KEYS]
            p.add(
                f"model.overrides.{key}",
                "is not an architecture field of this family",
                value=value,
                fix=did_you_mean(str(key), names, what="fields"),
            )
            continue
        if isinstance(getattr(base, key), tuple) and isinstance(value, list | tuple):
            value = tuple(value)
        changes[key] = value
    p.raise_if_any()
    return dataclasses.replace(base, **changes)


def recompute_fields(train: Any) -> dict[str, Any]:
    """The family config's ``recompute_blocks`` / ``recompute_attention`` for ``train``
    (``train.recompute``: none, selective (the blocks run again in the backward, their
    self-attention's outputs kept) or full (attention too); ``train.recompute_layers``: the
    first n blocks, null every block)."""
    mode = getattr(train, "recompute", "none") if train is not None else "none"
    if mode in (None, "none"):  # null: the memory plan has not chosen yet
        return {"recompute_blocks": 0, "recompute_attention": False}
    layers = train.recompute_layers
    return {
        "recompute_blocks": -1 if layers is None else int(layers),
        "recompute_attention": mode == "full",
    }


def model_config(model: Any, train: Any = None) -> Any:
    """The architecture of the run (the family's config dataclass, validated): the
    checkpoint's with ``model.init_from``, else the flavor's with ``model.overrides`` laid
    over it; ``recompute_blocks`` / ``recompute_attention`` from ``train`` (``train.recompute``
    and ``train.recompute_layers``; None: no recompute)."""
    family = model_family(model)
    module = family.load()
    if model.init_from:
        if model.overrides:
            raise ConfigError(
                "changes the architecture that model.init_from's config.json gives",
                key="model.overrides",
                value=dict(model.overrides),
                fix="drop model.overrides to fine-tune the checkpoint as it is",
            )
        if model.name != family.name:
            raise ConfigError(
                f"model.init_from holds a {family.name!r} checkpoint",
                key="model.name",
                value=model.name,
                fix=f"set model.name={family.name} (or leave the default)",
            )
        base = module.read_config(model.init_from)
    else:
        base = _with_overrides(module.flavor(model.flavor), dict(model.overrides))
    arch = dataclasses.replace(base, **recompute_fields(train))
    try:
        arch.validate(prefix="model")
    except ConfigError as exc:  # name the key the user set: model.overrides.<field>
        raise ConfigError(
            [
                dataclasses.replace(p, key=_override_key(p.key, model.overrides))
                for p in exc.problems
            ]
        ) from None
    return arch


def _override_key(key: str | None, overrides: dict[str, Any]) -> str | None:
    field = (key or "").removeprefix("model.")
    return f"model.overrides.{field}" if field in overrides else key


def _check_shapes(
    p: ProblemCollector, key: str, shapes: Any, patch: tuple[int, ...], where: str
) -> None:
    for shape in shapes:
        if len(shape) != 3 or any(int(s) % int(q) for s, q in zip(shape, patch)):
            p.add(
                key,
                f"{where}latents (T, H, W) = {tuple(int(s) for s in shape)} are not divisible "
                f"by the model's patch {tuple(patch)}",
                fix="use latent sizes that are multiples of the patch (videos: height and width "
                "multiples of 16 for Wan's 8x VAE and 2x2 patch)",
            )
            return


def _check_data(p: ProblemCollector, cfg: Any, arch: Any) -> None:
    from longboat.diffusion.data.schema import LatentsDataConfig, SyntheticSquaresDataConfig

    data = cfg.data
    if not isinstance(data, LatentsDataConfig):
        p.add(
            "data.name",
            "is not a latent dataset kind",
            value=getattr(data, "name", None),
            fix=f"use one of {', '.join(DATA_KINDS)} (data=latents or data=synthetic_squares)",
        )
        return
    try:
        data.validate("data")
    except ConfigError as exc:
        p.extend(exc)
    synthetic = isinstance(data, SyntheticSquaresDataConfig)
    manifests = [] if synthetic else _manifest_sets(p, data)  # missing datasets named now
    if not synthetic and data.caption_dropout > 0:
        from longboat.diffusion.data.empty_caption import EMPTY_CAPTION

        train_dirs = [*data.paths, *([data.path] if data.path else [])]
        lacking = [d for d in train_dirs if (Path(d) / "manifest.json").is_file()
                   and not (Path(d) / EMPTY_CAPTION).is_file()]  # fmt: skip
        if lacking:
            p.add(
                "data.caption_dropout",
                f"needs the empty caption's embedding, which {', '.join(lacking)} lacks "
                f"({EMPTY_CAPTION}: written by `data prepare` since it carries one)",
                value=data.caption_dropout,
                fix="run the same `longboat-diffusion data prepare` again over each dataset "
                "(it adds the file and re-encodes nothing), or data.caption_dropout=0",
            )
    if arch is None:
        return
    if not synthetic:
        _check_pooled(p, data, arch)
    patch = tuple(int(v) for v in arch.latent_patch)
    if tuple(data.patch_size) != patch:
        p.add(
            "data.patch_size",
            f"differs from the model's patch {list(patch)} (packing counts tokens with it)",
            value=list(data.patch_size),
            fix=f"set data.patch_size={list(patch)}",
        )
    if arch.latent_channels != arch.latent_out_channels:
        p.add(
            "model.init_from",
            f"latent channels in {arch.latent_channels} != out {arch.latent_out_channels}: an "
            "image-conditioned checkpoint, which text-to-video training does not feed",
            value=cfg.model.init_from,
            fix="start from a text-to-video checkpoint",
        )
    if synthetic:
        sets = [("data", data.latent_channels, data.text_dim, data.shapes, "data.shapes", "")]
    else:
        sets = manifests
    for key, channels, text_dim, shapes, shape_key, where in sets:
        if channels != arch.latent_channels:
            p.add(
                "data.latent_channels" if key == "data" else key,
                f"latents of {channels} channels, the model takes {arch.latent_channels}",
                value=channels,
                fix="use data of the model's latent space (its VAE), or a model of "
                f"{channels} channels",
            )
        if text_dim != arch.text_dim:
            p.add(
                "data.text_dim" if key == "data" else key,
                f"text embeddings of width {text_dim}, the model's text_dim is {arch.text_dim}",
                value=text_dim,
                fix="use captions encoded by the model's text encoder (or "
                f"model.overrides.text_dim={text_dim} for a new model)",
            )
        _check_shapes(p, shape_key, shapes, patch, where)


def _check_pooled(p: ProblemCollector, data: Any, arch: Any) -> None:
    """Datasets with pooled caption embeddings (FLUX's CLIP) against the model's width."""
    import json

    want = int(getattr(arch, "pooled_projection_dim", 0) or 0)
    for key, d in [("data.paths", d) for d in data.paths] + [
        ("data.eval_paths", d) for d in data.eval_paths
    ]:
        manifest = Path(d) / "manifest.json"
        if not manifest.is_file():
            continue
        width = int(json.loads(manifest.read_text()).get("pooled_dim", 0))
        if width and width != want:
            what = f"pooled width {want}" if want else "no pooled caption embedding"
            p.add(key, f"{d}: pooled caption embeddings of width {width}, the model takes "
                  f"{what}", value=str(d),
                  fix="use data prepared with the model's own pipeline")  # fmt: skip


def _manifest_sets(p: ProblemCollector, data: Any) -> list[tuple[str, int, int, Any, str, str]]:
    """(key, channels, text_dim, shapes, key, where) of every dataset directory ``data``
    reads."""
    from longboat.diffusion.data.errors import DataError
    from longboat.diffusion.data.shards import read_manifest, shard_infos

    dirs = [("data.paths", d) for d in data.paths]
    dirs += [("data.path", data.path)] if data.path else []
    dirs += [("data.eval_paths", d) for d in data.eval_paths]
    out = []
    for key, d in dirs:
        root = Path(d)
        if not (root / "manifest.json").is_file():
            p.add(
                key,
                f"{root}: no manifest.json (not a latent dataset)",
                value=str(d),
                fix="point it at a directory written by `longboat-diffusion data prepare`",
            )
            continue
        try:
            m = read_manifest(root)
            infos = shard_infos(m, str(root / "manifest.json"))
        except (DataError, KeyError, ValueError) as exc:
            p.add(key, f"{root}: unreadable manifest ({exc})", value=str(d))
            continue
        shapes = [shape for info in infos for shape in info.latent_shapes]
        channels, text_dim = int(m["latent_channels"]), int(m["text_dim"])
        out.append((key, channels, text_dim, shapes, key, f"{root}: "))
    return out


def _check_run(p: ProblemCollector, cfg: Any) -> None:
    run = cfg.diffusion
    if run.cpu_precision not in CPU_PRECISIONS:
        p.add(
            "diffusion.cpu_precision",
            "unsupported on CPU",
            value=run.cpu_precision,
            fix=f"use one of {', '.join(CPU_PRECISIONS)}",
        )
    sigmas = list(run.eval_sigmas)
    if not sigmas or any(not 0.0 < float(s) <= 1.0 for s in sigmas):
        p.add(
            "diffusion.eval_sigmas",
            "must be one or more noise levels in (0, 1]",
            value=sigmas,
            fix="e.g. [0.25, 0.5, 0.75]",
        )
    for key, least in (
        ("eval_batch_size", 1),
        ("eval_samples", 0),
        ("preview_captions", 0),
        ("preview_every", 0),
        ("sample_steps", 1),
        ("num_threads", 0),
    ):
        value = getattr(run, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            p.add(f"diffusion.{key}", f"must be an integer >= {least}", value=value)
    if run.preview_format not in ("gif", "mp4"):
        p.add("diffusion.preview_format", "unknown format", value=run.preview_format,
              fix="use gif or mp4")  # fmt: skip
    elif run.preview_format == "mp4" and run.preview:
        import importlib.util

        if importlib.util.find_spec("av") is None:
            p.add("diffusion.preview_format", "mp4 previews need PyAV", value="mp4",
                  fix="pip install 'longboat-diffusion[prepare]', or diffusion.preview_format=gif")  # fmt: skip
    if run.sample_shift is not None and not run.sample_shift > 0:
        p.add("diffusion.sample_shift", "must be > 0 (or null)", value=run.sample_shift)
    data = cfg.data
    if getattr(data, "batching", None) == "pack" and cfg.train.micro_batch_size != 1:
        p.add(
            "train.micro_batch_size",
            "with data.batching=pack a micro-batch is one pack of data.max_tokens tokens",
            value=cfg.train.micro_batch_size,
            fix="set train.micro_batch_size=1 (train.global_batch_size then counts packs)",
        )


def check_experiment(cfg: Any) -> Any:
    """Raise one ``ConfigError`` naming every problem of ``cfg`` (a
    ``DiffusionExperimentConfig``); returns the model's architecture config."""
    p = ProblemCollector()
    arch = None
    try:
        arch = model_config(cfg.model, cfg.train)
    except ConfigError as exc:
        p.extend(exc)
    try:
        cfg.objective.validate("objective")
    except ConfigError as exc:
        p.extend(exc)
    _check_data(p, cfg, arch)
    _check_run(p, cfg)
    layers = cfg.train.recompute_layers
    if arch is not None and layers is not None and layers > arch.num_blocks:
        p.add(
            "train.recompute_layers",
            f"is more than the model's {arch.num_blocks} blocks",
            value=layers,
            fix=f"use at most {arch.num_blocks} (null: every block)",
        )
    if arch is not None:
        from longboat.diffusion.train.pipeline_export import check_pipeline_source

        family = model_family(cfg.model)
        check_pipeline_source(p, cfg, family.diffusers_classes[0], arch.latent_channels)
        from longboat.diffusion.train.lora import lora_problems

        lora_problems(p, cfg, family, arch)
        par = cfg.parallel
        try:
            arch.validate_parallel(
                tensor_parallel=par.tensor_parallel, context_parallel=par.context_parallel
            )
        except ConfigError as exc:
            p.extend(exc)
    p.raise_if_any()
    return arch


def validate_diffusion(cfg: Any, world_size: int | None, problems: ProblemCollector) -> None:
    """The stack's compose-time validator (``Stack.validators``): ``check_experiment`` on the
    typed config, its problems added to core's."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException:
        return  # a missing or mistyped value: core reports it
    if getattr(typed, "stack", None) != "diffusion":
        return
    try:
        check_experiment(typed)
    except ConfigError as exc:
        known = {(q.key, q.message) for q in problems.problems}
        for q in exc.problems:
            if (q.key, q.message) not in known:
                problems.problems.append(q)

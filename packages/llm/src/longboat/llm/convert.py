"""Offline conversion between HF directories and longboat native (DCP) checkpoints.

The native checkpoint is what ``CheckpointManager`` writes: the megatron model's
state dict at tensor/pipeline/expert parallel 1 (DCP files + manifest), with the
model config in the manifest so ``native-to-hf`` needs no flags.  Conversion runs
in one process (a world-size-1 gloo group: megatron needs process groups).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import CheckpointConfig
from longboat.core.family import find_family
from longboat.core.megatron import parallel_state as mparallel
from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.llm.build import build_model
from longboat.llm.hf_checkpoint import check_matches_flavor, load_hf, read_hf_config, save_hf

Progress = Callable[[int, int], None]


def _checkpoint_cfg(out: Path) -> CheckpointConfig:
    return CheckpointConfig(dir=str(out), keep_last=0, async_save=False, resume="none")


def hf_to_native(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    model: str | None = None,
    flavor: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Convert an HF directory into a native checkpoint under ``out_dir`` (step 0)."""
    from longboat.core.checkpoint import CheckpointManager

    cfg = read_hf_config(hf_dir)
    if model is not None and model != cfg.name:
        find_family("llm", model)  # an unknown name fails listing the families
        raise ConfigError(
            f"--model {model} but {hf_dir}/config.json is a {cfg.name!r} checkpoint. "
            f"Fix: pass --model {cfg.name} or omit it."
        )
    if flavor is not None:
        wanted = find_family("llm", cfg.name).flavor(flavor)
        check_matches_flavor(wanted, cfg, f"{hf_dir}/config.json")
        cfg = dataclasses.replace(cfg, flavor=wanted.flavor)
    with mparallel.single_process():
        chunks = build_model(cfg)
        load_hf(chunks, cfg, hf_dir, progress=progress)
        manager = CheckpointManager(
            _checkpoint_cfg(Path(out_dir)), {"model": dataclasses.asdict(cfg)}
        )
        return manager.save(0, {"model": chunks[0]})


def _resolve_native(path: Path) -> Path:
    if (path / "manifest.json").is_file():
        return path
    from longboat.core.checkpoint import CheckpointManager

    latest = CheckpointManager(_checkpoint_cfg(path)).latest()
    if latest is None:
        raise FileNotFoundError(
            f"{path}: no finished native checkpoint (no manifest.json here or in a step_* "
            "folder). Fix: point at a checkpoint folder written by longboat."
        )
    return latest


def native_config(path: str | Path) -> DecoderModelConfig:
    """The model config stored in a native checkpoint's manifest."""
    from longboat.core.checkpoint import read_manifest

    manifest = read_manifest(_resolve_native(Path(path)))
    model = dict(manifest.config.get("model") or {})
    if not model:
        raise ValueError(f"{path}: the manifest has no model config; was it written by longboat?")
    schema = find_family("llm", str(model.get("name"))).model_schema()
    names = {f.name for f in dataclasses.fields(schema)}
    return schema(**{k: v for k, v in model.items() if k in names})


def run_sources(path: str | Path) -> tuple[Path | None, Path | None]:
    """``(tokenizer dir, source HF dir)`` of the training run that wrote a native checkpoint
    (from its manifest's config: ``data.tokenizer``, the quickstart's tokenizer,
    ``model.init_from``), each None when unknown or gone."""
    from longboat.core.checkpoint import read_manifest
    from longboat.llm.train.checks import TOKENIZER_FILES

    config = read_manifest(_resolve_native(Path(path))).config
    data, model = config.get("data") or {}, config.get("model") or {}
    # Checkpoints written before model.init_from kept the HF source in llm.init_from_hf.
    init = model.get("init_from") or (config.get("llm") or {}).get("init_from_hf")
    source = Path(init) if init else None
    candidates = [data.get("tokenizer"), data.get("out_dir") and f"{data['out_dir']}/tokenizer"]
    candidates.append(source)
    tokenizer = next(
        (
            Path(c)
            for c in candidates
            if c and any((Path(c) / name).is_file() for name in TOKENIZER_FILES)
        ),
        None,
    )
    return tokenizer, source if source is not None and source.is_dir() else None


def native_to_hf(
    native: str | Path, out_dir: str | Path, *, tokenizer: str | Path | None = None
) -> Path:
    """Convert a native checkpoint (folder or checkpoint root) into an HF directory, with the
    tokenizer (``tokenizer``, default: the training run's) and its special tokens."""
    from longboat.core.checkpoint import CheckpointManager
    from longboat.llm.train.export import write_generation_files

    path = _resolve_native(Path(native))
    cfg = native_config(path)
    run_tokenizer, source = run_sources(path)
    with mparallel.single_process():
        chunks = build_model(cfg)
        manager = CheckpointManager(_checkpoint_cfg(path.parent))
        manager.load({"model": chunks[0]}, path)
        out = save_hf(chunks, cfg, out_dir)
    write_generation_files(out, tokenizer or run_tokenizer, source)
    return out


def describe(cfg: DecoderModelConfig) -> dict[str, Any]:
    """A short summary for the CLI."""
    return {
        "model": cfg.name,
        "flavor": cfg.flavor,
        "layers": cfg.num_layers,
        "hidden": cfg.hidden_size,
        "experts": cfg.num_experts,
    }

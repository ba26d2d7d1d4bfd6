"""A VLM run's native (DCP) checkpoint as the Hugging Face directory its export would be.

The checkpoint's manifest holds the run's config: the model is built from it as the run
built it (``training.build_run_model``, the run's LoRA adapters included), the checkpoint's
weights are loaded into it, and the same writer as the run's export saves it (the adapters
merged), with the tokenizer, ``preprocessor_config.json`` and the stop ids. It runs in one
CPU process (a world-size-1 group: megatron needs process groups) and needs no training
data, only the run's tokenizer (``data.tokenizer``, the quickstart's, or
``model.init_from``'s; ``tokenizer=`` overrides it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["native_to_hf", "resolve_native", "run_config"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
"""Any of these marks a tokenizer directory."""


def resolve_native(path: str | Path) -> Path:
    """``path`` when it is a checkpoint folder (it has ``manifest.json``), else the newest
    finished checkpoint under it (a ``checkpoint.dir``); ``FileNotFoundError`` otherwise."""
    from longboat.core.checkpoint import CheckpointManager
    from longboat.core.config.schema import CheckpointConfig

    folder = Path(path)
    if (folder / "manifest.json").is_file():
        return folder
    root = CheckpointConfig(dir=str(folder), keep_last=0, async_save=False, resume="none")
    latest = CheckpointManager(root).latest() if folder.is_dir() else None
    if latest is None:
        raise FileNotFoundError(
            f"{folder}: no finished native checkpoint (no manifest.json here or in a step_* "
            "folder). Fix: point at a checkpoint folder a longboat-vlm run wrote, or at its "
            "Hugging Face export."
        )
    return latest


def run_config(checkpoint: Path) -> Any:
    """The config of the VLM run that wrote ``checkpoint`` (its manifest's), as dataclasses."""
    from longboat.core.checkpoint import read_manifest
    from longboat.core.config.compose import stored_config

    config = read_manifest(checkpoint).config
    if config.get("stack") != "vlm":
        raise ValueError(
            f"{checkpoint} was written by a {config.get('stack') or 'non-longboat'} run, not "
            "longboat-vlm"
        )
    return stored_config(config, "vlm")


def _tokenizer_dir(cfg: Any, checkpoint: Path) -> Path:
    data = cfg.data
    candidates = [getattr(data, "tokenizer", None), cfg.model.init_from]
    if data.name == "shapes":  # the quickstart writes its tokenizer beside its data
        candidates.insert(0, str(Path(data.out_dir) / "tokenizer"))
    for candidate in candidates:
        if candidate and any((Path(candidate) / f).is_file() for f in TOKENIZER_FILES):
            return Path(candidate)
    tried = ", ".join(str(c) for c in candidates if c) or "none recorded"
    raise FileNotFoundError(
        f"{checkpoint}: the run's tokenizer is gone (tried: {tried}). Fix: pass --tokenizer "
        "DIR (the tokenizer the run trained with)"
    )


def native_to_hf(
    native: str | Path, out_dir: str | Path, *, tokenizer: str | Path | None = None
) -> Path:
    """Write the Hugging Face directory of the native checkpoint ``native`` (a checkpoint
    folder or a ``checkpoint.dir``) to ``out_dir``: what the run's export would hold had it
    stopped there (see the module doc). Returns ``out_dir``."""
    from longboat.core.checkpoint import CheckpointManager
    from longboat.core.config.schema import CheckpointConfig
    from longboat.core.device import get_accelerator
    from longboat.core.distributed import run_precision
    from longboat.core.megatron import parallel_state
    from longboat.vlm.train.data import RunData, run_processing
    from longboat.vlm.train.export import write_generation_config
    from longboat.vlm.train.lora import apply_language_lora, merged_language
    from longboat.vlm.train.training import build_run_model, model_config, model_family

    path = resolve_native(native)
    cfg = run_config(path)
    family = model_family(cfg)
    module = family.load()
    tok_dir = Path(tokenizer) if tokenizer is not None else _tokenizer_dir(cfg, path)
    processing = run_processing(cfg, model_config(cfg), tok_dir)
    precision = run_precision(cfg.train.precision, cfg.vlm.cpu_precision, get_accelerator("cpu"))
    out = Path(out_dir)
    with parallel_state.single_process():
        model, _, _ = build_run_model(cfg, module, processing.model_cfg, precision, "cpu")
        apply_language_lora(model, cfg.lora, frozen=cfg.model.freeze, seed=cfg.train.seed)
        folder = CheckpointConfig(dir=str(path.parent), keep_last=0, resume="none")
        CheckpointManager(folder).load({"model": model}, path)
        with merged_language(model):
            module.save_hf(model, processing.model_cfg, out)
    RunData(
        train=None,
        eval=None,
        model_cfg=processing.model_cfg,
        tokenizer=processing.tokenizer,
        processor_config=processing.processor.config,
    ).save_processing(out)
    write_generation_config(out, processing.tokenizer, cfg.model.init_from)
    return out

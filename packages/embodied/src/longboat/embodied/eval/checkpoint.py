"""A training run's native checkpoint as a policy that acts: ``checkpoint_policy(path)``.

The checkpoint is what the trainer writes under ``checkpoint.dir`` (``step_XXXXXXXX/``: DCP
shards, per-rank extras and ``manifest.json``, whose ``config`` is the run's resolved
config). The policy is rebuilt as the run built it (``training.build_run_model``: its
flavor, overrides, freezing and LoRA adapters) on the CPU, in one process, whatever
parallelism wrote the checkpoint (DCP reshards); the checkpoint's weights are loaded into
it, with ``train.master_weights`` the optimizer's fp32 masters in place of their bf16
copies (as the run's export takes them). The processor (camera order, normaliser
statistics, tokenizer) is the run's, rebuilt from its dataset (``data.path``, or the
synthetic set in its ``output_dir``) and its tokenizer, so both must still be where the run
read them.

``resolve_checkpoint`` accepts a checkpoint folder, a ``checkpoint.dir`` (its newest finished
checkpoint) or a run directory (``<output_dir>/checkpoints``'s newest).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError

CHECKPOINT_KEY = "checkpoint"
"""How the command line names a native checkpoint: ``checkpoint=PATH``."""
CHECKPOINTS_DIR = "checkpoints"
"""The folder of a run directory that holds its checkpoints (``checkpoint.dir``'s default)."""
STACK = "embodied"


def resolve_checkpoint(path: str | Path, key: str = CHECKPOINT_KEY) -> Path:
    """The checkpoint folder ``path`` names: itself when it holds ``manifest.json``, else the
    newest finished checkpoint in it or in its ``checkpoints/``; a ``ConfigError`` (naming
    ``key``) for a folder that is neither."""
    from longboat.core.checkpoint import MANIFEST_NAME, CheckpointManager
    from longboat.core.config.schema import CheckpointConfig

    folder = Path(path)
    if (folder / MANIFEST_NAME).is_file():
        return folder
    for candidate in (folder, folder / CHECKPOINTS_DIR):
        if not candidate.is_dir():
            continue
        root = CheckpointConfig(dir=str(candidate), keep_last=0, async_save=False, resume="none")
        latest = CheckpointManager(root).latest()
        if latest is not None:
            return latest
    raise ConfigError(
        f"{folder} is neither a native checkpoint (no {MANIFEST_NAME}) nor a folder with a "
        f"finished one (no step_XXXXXXXX/{MANIFEST_NAME} in it or in its {CHECKPOINTS_DIR}/)",
        key=key,
        value=str(path),
        fix="give a run directory (<output_dir>), its checkpoint.dir or one step_XXXXXXXX "
        "folder of a longboat-embodied run; an export folder is given without checkpoint=",
    )


def run_config(checkpoint: Path, key: str = CHECKPOINT_KEY) -> Any:
    """The resolved config of the longboat-embodied run that wrote ``checkpoint`` (its
    manifest's), as the stack's dataclasses."""
    from longboat.core.checkpoint import read_manifest
    from longboat.core.config.compose import stored_config

    config = read_manifest(checkpoint).config
    if config.get("stack") != STACK:
        raise ConfigError(
            f"{checkpoint} was written by a {config.get('stack') or 'non-longboat'} run, not "
            "longboat-embodied",
            key=key,
            value=str(checkpoint),
            fix="give a checkpoint of a longboat-embodied run",
        )
    return stored_config(config, STACK)


def run_processor(cfg: Any, model_cfg: Any, tokenizer: Path | None, overrides: dict) -> Any:
    """The ``PolicyProcessor`` the run's export would hold: its collator (cameras, batch
    spec) and normaliser statistics from the run's dataset, its tokenizer."""
    from longboat.core.data.batch_plan import batch_layout
    from longboat.embodied.inference.processor import PolicyProcessor
    from longboat.embodied.train.reference_formats import prompt_tokenizer
    from longboat.embodied.train.training import open_run_data

    if cfg.data.path and not Path(cfg.data.path).exists():
        raise ConfigError(
            "the run's dataset is gone: its statistics normalise the policy's inputs",
            key="data.path",
            value=cfg.data.path,
            fix="put the dataset back where the run read it, or evaluate the run's export",
        )
    prompts = prompt_tokenizer(tokenizer, cfg.model.name, model_cfg) if tokenizer else None
    micro = cfg.train.micro_batch_size
    data = open_run_data(cfg, model_cfg, batch_layout(micro, micro, 1), True, prompts=prompts)
    data.collate.fixed_text_length = bool(cfg.train.cuda_graph)  # as the run's collator
    return PolicyProcessor.from_run(
        cfg.model.name,
        data.collate,
        data.norm_stats,
        tokenizer=tokenizer,
        precision=cfg.train.precision,
        model_overrides=overrides,
    )


def load_checkpoint_weights(model: Any, checkpoint: Path, *, master_weights: bool) -> None:
    """Load the model state of ``checkpoint`` into ``model`` (any world size wrote it);
    ``master_weights``: then replace every trainable parameter by its fp32 master from the
    optimizer state (``MasterWeightAdamW`` saves it as ``master``)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from longboat.core.checkpoint import CheckpointManager
    from longboat.core.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
    from longboat.core.config.schema import CheckpointConfig

    folder = CheckpointConfig(dir=str(checkpoint.parent), keep_last=0, resume="none")
    CheckpointManager(folder).load({"model": model}, checkpoint)
    if not master_weights:
        return
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    masters = {n: torch.empty(p.shape, dtype=torch.float32) for n, p in trainable.items()}
    template = {"optimizer": {"state": {n: {"master": t} for n, t in masters.items()}}}
    with warnings.catch_warnings():  # DCP warns that it loads in one process: it does
        warnings.filterwarnings("ignore", message=r"torch\.distributed is", category=UserWarning)
        reader = SafeFileSystemReader(checkpoint)
        dcp.load(template, storage_reader=reader, planner=SafeLoadPlanner())
    with torch.no_grad():
        for name, p in trainable.items():
            p.data = masters[name]


def checkpoint_policy(
    path: str | Path,
    suite: Any = None,
    *,
    device: str = "cpu",
    n_action_steps: int | None = None,
    key: str = CHECKPOINT_KEY,
) -> Any:
    """The ``inference.Policy`` of the native checkpoint ``path`` (``resolve_checkpoint``),
    built and loaded as the module doc says; with ``suite``, first checked against it
    (``runner.check_compatible``) before the weights load."""
    from longboat.embodied.inference.policy import Policy
    from longboat.embodied.models.init_from import resolve_model_config
    from longboat.embodied.train.reference_formats import run_tokenizer, stand_in_tokenizer
    from longboat.embodied.train.training import build_run_model, model_overrides

    checkpoint = resolve_checkpoint(path, key)
    cfg = run_config(checkpoint, key)
    tokenizer = run_tokenizer(cfg) or stand_in_tokenizer(cfg, True)
    overrides = model_overrides(cfg, tokenizer=tokenizer is not None)
    model_cfg = resolve_model_config(
        cfg.model.name, cfg.model.flavor, overrides, cfg.model.init_from
    )
    processor = run_processor(cfg, model_cfg, tokenizer, overrides)
    if suite is not None:
        from longboat.embodied.eval.runner import check_compatible

        emb = processor.embodiments[0]
        check_compatible(suite, processor.cameras, emb.state_dim, emb.action_dim)
    model, _ = build_run_model(cfg, model_cfg, initial_weights=False)
    load_checkpoint_weights(model, checkpoint, master_weights=bool(cfg.train.master_weights))
    if cfg.ema.enabled and cfg.ema.export:
        print(
            f"{checkpoint}: the trained weights act (the run exports their average, "
            "ema.export; its export folder evaluates that)",
            flush=True,
        )
    return Policy(model, processor, device=device, n_action_steps=n_action_steps)


__all__ = [
    "CHECKPOINT_KEY",
    "checkpoint_policy",
    "load_checkpoint_weights",
    "resolve_checkpoint",
    "run_config",
    "run_processor",
]

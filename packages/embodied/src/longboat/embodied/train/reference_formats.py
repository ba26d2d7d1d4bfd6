"""What a run takes from and gives back to its policy's reference formats besides weights:
the prompt tokenizer (``PolicyFamily.prompts``), the normaliser statistics of a released
checkpoint (``CheckpointAdapter.statistics``), and the export in a reference format at the
end (``export.format``, ``PolicyFamily.export_formats``)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from longboat.core.config.errors import ConfigError
from longboat.embodied.data import LeRobotMetadata
from longboat.embodied.inference.processor import PROCESSOR_NAME, TOKENIZER_DIR
from longboat.embodied.models import hf_backbones
from longboat.embodied.models.registry import policy
from longboat.embodied.train.policy_batch import ACTION_KEY, STATE_KEY

BYTE_TOKENIZER = "byte"
"""``model.tokenizer=byte``: the byte-level stand-in (``ByteTokenizer``), no Hugging Face
tokenizer."""


def run_tokenizer(cfg: Any) -> Path | None:
    """The tokenizer directory of a run (``model.tokenizer``, else found in
    ``model.init_from``); None for from-scratch runs without one. A run whose pretrained
    language model needs one and has none is a ConfigError naming ``model.tokenizer``
    (e.g. pi0.5 from LeRobot / PaliGemma weights, GR00T from the released Eagle backbone),
    and so is a tokenizer for a policy that reads none."""
    prompts = policy(cfg.model.name).prompts
    given = None if cfg.model.tokenizer == BYTE_TOKENIZER else cfg.model.tokenizer
    if prompts is None:
        if given:
            raise ConfigError(
                f"model.name={cfg.model.name} reads no Hugging Face tokenizer's prompts",
                key="model.tokenizer",
                value=cfg.model.tokenizer,
                fix="set model.tokenizer=null (the byte-level stand-in tokenizer)",
            )
        return None
    if cfg.model.tokenizer == BYTE_TOKENIZER:
        found = None
    else:
        found = prompts.find_tokenizer(given, cfg.model.init_from)
    if found is None and prompts.needs_tokenizer(cfg.model.init_from):
        raise prompts.missing_tokenizer_error(cfg.model.init_from)
    return found


STAND_IN_DIR = "tokenizer"
"""Where a from-scratch run's stand-in tokenizer is written, under ``output_dir``."""


def stand_in_tokenizer(cfg: Any, is_main: bool) -> Path | None:
    """The tokenizer a from-scratch run without one trains with (the policy's
    ``PromptProcessor.stand_in``, e.g. pi0.5's byte-level BPE, so the run's LeRobot export
    holds a tokenizer that LeRobot's preprocessor reads), written once into
    ``<output_dir>/tokenizer`` by rank 0 and kept for a resume; None where the policy makes
    none, none can be made, or ``model.tokenizer=byte`` asks for the byte-level stand-in.
    Call it where ``run_tokenizer`` found none."""
    prompts = policy(cfg.model.name).prompts
    if prompts is None or prompts.stand_in is None or cfg.model.tokenizer == BYTE_TOKENIZER:
        return None
    if prompts.needs_tokenizer(cfg.model.init_from):  # run_tokenizer refused it already
        return None
    from longboat.embodied.models.registry import get_config

    directory = Path(cfg.output_dir) / STAND_IN_DIR
    made: list[Path | None] = [directory]
    if is_main and not (directory / "tokenizer.json").is_file():
        model_cfg = get_config(cfg.model.name, cfg.model.flavor, dict(cfg.model.overrides))
        made = [prompts.stand_in(directory, model_cfg)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(made, src=0)
    return made[0]


def prompt_tokenizer(path: Path, model_name: str, model_cfg: Any) -> Any:
    """The run's prompt tokenizer (the policy's ``PromptProcessor.build``), checked against
    the model before it is built (e.g. no id past the vocabulary)."""
    prompts = policy(model_name).prompts
    if prompts is None:
        raise ConfigError(
            f"model.name={model_name} reads no Hugging Face tokenizer's prompts",
            key="model.tokenizer",
            value=str(path),
        )
    return prompts.build(path, model_cfg)


def checkpoint_statistics(cfg: Any) -> Any:
    """For a run from a released checkpoint that carries normaliser statistics:
    ``stats_for(index, names, meta)``, the checkpoint's statistics of sub-dataset ``index``
    of those named ``names`` (None where it has none); else None."""
    init_from = cfg.model.init_from
    checkpoints = policy(cfg.model.name).checkpoints
    if (
        checkpoints is None
        or checkpoints.statistics is None
        or not init_from
        or hf_backbones.is_hf_backbone(init_from)
    ):
        return None
    statistics = checkpoints.statistics

    def stats_for(index: int, names: list[str], meta: LeRobotMetadata) -> Mapping[str, Any] | None:
        widths = {k: int(meta.features[k]["shape"][0]) for k in (STATE_KEY, ACTION_KEY)}
        return statistics(init_from, names, index, widths)

    return stats_for


def plan_export(cfg: Any, model_cfg: Any, num_datasets: int) -> tuple[str, str | None]:
    """(the reference format the run's end writes, or ``native``; why ``auto`` writes none).
    An explicit format the run cannot be written in is a ConfigError at the start."""
    fmt = cfg.export.format
    if not cfg.export.enabled or fmt == "native":
        return "native", None
    family = policy(cfg.model.name)
    chosen = family.export_format(fmt) if fmt != "auto" else next(iter(family.export_formats), None)
    if chosen is None:
        if fmt == "auto":
            return "native", None
        formats = [f.name for f in family.export_formats]
        raise ConfigError(
            f"model.name={cfg.model.name} is written in "
            + (", ".join(formats) if formats else "no reference format"),
            key="export.format",
            value=fmt,
            fix="use export.format=auto or native",
        )
    why = chosen.unavailable(model_cfg, num_datasets)
    if why is None:
        return chosen.name, None
    if fmt != "auto":
        raise ConfigError(f"cannot be written for this run: {why}", key="export.format", value=fmt)
    return "native", why


def write_export(
    model_name: str,
    fmt: str,
    export_dir: Path,
    *,
    root: Path,
    tokenizer: Path | None,
    cameras: list[str],
    stats: list[dict[str, Any]],
) -> Path:
    """Write the native export ``export_dir`` of a ``model_name`` run in ``fmt`` into
    ``export_dir/<fmt>`` with the statistics each sub-dataset was normalised with; returns
    that directory."""
    chosen = policy(model_name).export_format(fmt)
    assert chosen is not None, fmt  # plan_export chose it
    out = chosen.write(
        export_dir,
        export_dir / chosen.name,
        root=root,
        tokenizer=tokenizer,
        cameras=cameras,
        stats=stats,
    )
    copy_processor(export_dir, out)
    return out


def copy_processor(export_dir: Path, out_dir: Path) -> None:
    """Ship the native export's processor (``processor.json``, its ``tokenizer/``) in a
    reference-format folder too, so ``load_policy`` acts with that folder alone."""
    source = Path(export_dir) / PROCESSOR_NAME
    if not source.is_file():
        return
    shutil.copyfile(source, Path(out_dir) / PROCESSOR_NAME)
    tokenizer = Path(export_dir) / TOKENIZER_DIR
    if tokenizer.is_dir() and not (Path(out_dir) / TOKENIZER_DIR).exists():
        shutil.copytree(tokenizer, Path(out_dir) / TOKENIZER_DIR)

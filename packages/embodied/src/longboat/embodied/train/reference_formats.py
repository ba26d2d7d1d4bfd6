"""What a run takes from and gives back to the reference formats besides weights: the
prompt tokenizer (pi0.5: LeRobot's prompt; GR00T: Isaac-GR00T's), the normaliser statistics of an Isaac-GR00T checkpoint (GR00T),
and the export in LeRobot's or Isaac-GR00T's layout at the end (``export.format``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.embodied.data import LeRobotMetadata
from longboat.embodied.models import hf_backbones
from longboat.embodied.models.pi05 import processor as pi05_processor
from longboat.embodied.train.policy_batch import ACTION_KEY, STATE_KEY

FORMAT_DIRS = {"lerobot": "lerobot", "isaac": "isaac"}
"""Sub-folder of the export directory each reference format is written to."""
FORMAT_NAMES = {"lerobot": "LeRobot pi0.5", "isaac": "Isaac-GR00T N1.6"}


def run_tokenizer(cfg: Any) -> Path | None:
    """The tokenizer directory of a run (``model.tokenizer``, else found in
    ``model.init_from``); None for from-scratch runs without one. A run whose pretrained
    language model needs one and has none is a ConfigError naming ``model.tokenizer``
    (pi0.5 from LeRobot / PaliGemma weights, GR00T from the released Eagle backbone)."""
    processor = _family_processor(cfg.model.name)
    found = processor.find_tokenizer(cfg.model.tokenizer, cfg.model.init_from)
    if found is None and processor.needs_tokenizer(cfg.model.init_from):
        raise processor.missing_tokenizer_error(cfg.model.init_from)
    return found


def _family_processor(name: str) -> Any:
    if name == "groot_n1_6":
        from longboat.embodied.models.groot_n1_6 import processor

        return processor
    return pi05_processor


def prompt_tokenizer(path: Path, model_name: str, model_cfg: Any) -> Any:
    """The run's prompt tokenizer, checked against the model before it is built: pi0.5's
    ``PromptTokenizer`` (LeRobot's ``tokenizer_max_length`` tokens, no id past the
    vocabulary), GR00T's ``GrootPromptTokenizer`` (Eagle's image tokens, the model's image
    token id, no id past the vocabulary)."""
    if model_name == "groot_n1_6":
        from longboat.embodied.models.groot_n1_6.processor import GrootPromptTokenizer

        return GrootPromptTokenizer(path, model_cfg)
    tokenizer = pi05_processor.PromptTokenizer(path, model_cfg.prompt_length())
    if tokenizer.vocab_size > model_cfg.llm.vocab_size:
        raise ConfigError(
            f"has {tokenizer.vocab_size} ids, more than the model's vocabulary of "
            f"{model_cfg.llm.vocab_size}",
            key="model.tokenizer",
            value=str(path),
            fix="use the tokenizer the checkpoint was trained with (PaliGemma's for pi0.5)",
        )
    return tokenizer


def checkpoint_statistics(cfg: Any) -> Any:
    """For a GR00T run from an Isaac-GR00T directory: ``stats_for(index, tag, meta)``, the
    checkpoint's statistics of a sub-dataset's tag (None where it has none); else None."""
    init_from = cfg.model.init_from
    if cfg.model.name != "groot_n1_6" or not init_from or hf_backbones.is_hf_backbone(init_from):
        return None
    from longboat.embodied.models.groot_n1_6.isaac_processor import checkpoint_stats

    def stats_for(index: int, tag: str, meta: LeRobotMetadata) -> Mapping[str, Any] | None:
        widths = {k: int(meta.features[k]["shape"][0]) for k in (STATE_KEY, ACTION_KEY)}
        return checkpoint_stats(init_from, tag, widths)

    return stats_for


def plan_export(cfg: Any, model_cfg: Any, num_datasets: int) -> tuple[str, str | None]:
    """(the reference format the run's end writes, or ``native``; why ``auto`` writes none).
    An explicit format the run cannot be written in is a ConfigError at the start."""
    fmt = cfg.export.format
    if not cfg.export.enabled or fmt == "native":
        return "native", None
    if cfg.model.name == "groot_n1_6":
        return "isaac", None
    why = None
    if not getattr(model_cfg, "state_in_prompt", False):
        why = (
            "the byte-level stand-in tokenizer spells no state in the prompt (set "
            "model.tokenizer=<dir> for LeRobot's prompt)"
        )
    elif model_cfg.image.crop_fraction != 1.0:
        why = (
            f"the policy crops its frames (image.crop_fraction={model_cfg.image.crop_fraction}), "
            "LeRobot's pi0.5 does not"
        )
    elif num_datasets > 1:
        why = (
            f"{num_datasets} sub-datasets, and LeRobot's pi0.5 normaliser holds one set of "
            "statistics"
        )
    if why is None:
        return "lerobot", None
    if fmt == "lerobot":
        raise ConfigError(f"cannot be written for this run: {why}", key="export.format", value=fmt)
    return "native", why


def write_export(
    fmt: str,
    export_dir: Path,
    *,
    root: Path,
    tokenizer: Path | None,
    cameras: list[str],
    stats: list[dict[str, Any]],
) -> Path:
    """Write the native export ``export_dir`` in ``fmt`` into ``export_dir/<fmt>`` with the
    statistics each sub-dataset was normalised with; returns that directory."""
    from longboat.embodied.train import lerobot_export

    out = export_dir / FORMAT_DIRS[fmt]
    if fmt == "lerobot":
        return lerobot_export.export_lerobot_pi05(
            export_dir, out, dataset=root, tokenizer=tokenizer, stats=stats[0]
        )
    embodiments = lerobot_export.run_embodiments(root, cameras, stats)
    out = lerobot_export.export_groot(export_dir, out, dataset=root, embodiments=embodiments)
    if tokenizer is not None:  # model.init_from finds it there (Isaac-GR00T reads past it)
        from longboat.embodied.models.groot_n1_6 import processor

        processor.copy_tokenizer(tokenizer, out / processor.TOKENIZER_DIR)
    return out

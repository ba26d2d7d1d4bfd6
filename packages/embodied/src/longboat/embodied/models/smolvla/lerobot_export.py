"""A trained SmolVLA run's native export as a LeRobot policy directory: ``config.json`` +
``model.safetensors`` (LeRobot's names) and the processor files with the dataset's
statistics, so ``SmolVLAPolicy.from_pretrained(out_dir)`` and
``make_pre_post_processors(cfg, pretrained_path=out_dir)`` load them. The normaliser is
``MIN_MAX`` for state and action: longboat's training maps both to [-1, 1] with the
dataset's min / max (LeRobot's MIN_MAX formula; longboat also clips to [-1, 1])."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.embodied.models.common.dataset_meta import (
    ACTION_KEY,
    STATE_KEY,
    state_action_features,
)
from longboat.embodied.models.common.lerobot_checkpoint import TRAINING_NORMALIZATION
from longboat.embodied.models.smolvla.lerobot_format import (
    backbone_mismatch,
    lerobot_config_for,
    read_lerobot_config,
    save_lerobot_smolvla,
)
from longboat.embodied.models.smolvla.lerobot_processors import save_lerobot_processors


def export_lerobot_smolvla(
    export_dir: str | Path,
    out_dir: str | Path,
    *,
    dataset: str | Path,
    stats: dict[str, Any] | None = None,
) -> Path:
    """Convert ``export_dir`` (``<output_dir>/export`` of a smolvla run) into a LeRobot policy
    directory ``out_dir`` with normaliser statistics ``stats`` (default: ``dataset``'s
    ``meta/stats.json``)."""
    from longboat.embodied.train.export import CONFIG_NAME, load_exported_policy

    export_dir, root = Path(export_dir), Path(dataset)
    exported = json.loads((export_dir / CONFIG_NAME).read_text())
    if exported.get("model_name") != "smolvla":
        raise ConfigError(
            f"{export_dir} holds a {exported.get('model_name')!r} policy, not smolvla",
            key="export_dir",
        )
    feats, stats = state_action_features(root, stats)
    model = load_exported_policy(export_dir)
    base = None
    init_from = exported.get("init_from")
    if init_from and (Path(init_from) / "config.json").is_file():
        base = read_lerobot_config(init_from)  # keeps LeRobot's non-architecture fields
    cfg = lerobot_config_for(
        model,
        state_dim=int(feats[STATE_KEY]["shape"][0]),
        action_dim=int(feats[ACTION_KEY]["shape"][0]),
        camera_keys=list(exported.get("cameras") or []),
        base=base,
        normalization=TRAINING_NORMALIZATION,
    )
    save_lerobot_smolvla(model, out_dir, cfg)
    save_lerobot_processors(out_dir, cfg, {k: stats[k] for k in (STATE_KEY, ACTION_KEY)})
    return Path(out_dir)


def unavailable(cfg: Any, num_datasets: int) -> str | None:
    """Why a run of config ``cfg`` on ``num_datasets`` sub-datasets cannot be written as a
    LeRobot SmolVLA policy (None: it can)."""
    if not getattr(cfg, "backbone_prompts", False):
        return (
            "the byte-level stand-in tokenizer's ids are not what LeRobot's preprocessor "
            "feeds (set model.tokenizer=<dir> to the backbone's tokenizer)"
        )
    why = backbone_mismatch(cfg)
    if why is not None:
        return why
    if num_datasets > 1:
        return (
            f"{num_datasets} sub-datasets, and LeRobot's SmolVLA normaliser holds one set of "
            "statistics"
        )
    return None


def write_run_export(
    export_dir: Path,
    out_dir: Path,
    *,
    root: Path,
    tokenizer: Path | None,
    cameras: list[str],
    stats: list[dict[str, Any]],
) -> Path:
    """The end of a run: its export in LeRobot's format (one sub-dataset's statistics)."""
    return export_lerobot_smolvla(export_dir, out_dir, dataset=root, stats=stats[0])


def convert(export_dir: Path, out_dir: Path, *, dataset: Path, **_: Any) -> Path:
    """The command line's conversion."""
    return export_lerobot_smolvla(export_dir, out_dir, dataset=dataset)

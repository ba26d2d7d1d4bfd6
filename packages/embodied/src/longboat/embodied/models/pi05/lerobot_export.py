"""A trained pi0.5 run's native export as a LeRobot policy directory:
``config.json`` + ``model.safetensors`` (LeRobot's names), the processor files with the
dataset's statistics and the run's tokenizer in ``tokenizer/`` (the processor names that
folder), so ``PI05Policy.from_pretrained(out_dir)`` and
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
from longboat.embodied.models.hf_backbones import is_hf_backbone
from longboat.embodied.models.pi05.lerobot_format import (
    lerobot_config_for,
    read_lerobot_config,
    save_lerobot_pi05,
)
from longboat.embodied.models.pi05.lerobot_processors import save_lerobot_processors


def export_lerobot_pi05(
    export_dir: str | Path,
    out_dir: str | Path,
    *,
    dataset: str | Path,
    tokenizer: str | Path | None = None,
    stats: dict[str, Any] | None = None,
) -> Path:
    """Convert ``export_dir`` (``<output_dir>/export`` of a pi05 run) into a LeRobot policy
    directory ``out_dir``, its normaliser statistics ``stats`` (default: ``dataset``'s
    ``meta/stats.json``), its tokenizer copied from ``tokenizer`` (default: the run's,
    recorded in the export)."""
    from longboat.embodied.train.export import CONFIG_NAME, load_exported_policy

    export_dir, root = Path(export_dir), Path(dataset)
    exported = json.loads((export_dir / CONFIG_NAME).read_text())
    if exported.get("model_name") != "pi05":
        raise ConfigError(
            f"{export_dir} holds a {exported.get('model_name')!r} policy; LeRobot's format "
            "is written for pi05 here (groot_n1_6: export_groot)",
            key="export_dir",
        )
    feats, stats = state_action_features(root, stats)
    tokenizer = tokenizer or exported.get("tokenizer")
    if not tokenizer:
        raise ConfigError(
            f"{export_dir} was trained with the byte-level stand-in tokenizer and discrete "
            "state tokens; LeRobot's processor would feed it PaliGemma's tokens of a prompt "
            "that spells the state",
            key="model.tokenizer",
            fix="train with model.tokenizer=<PaliGemma tokenizer dir> (a pretrained pi0.5 "
            "finds it in model.init_from)",
        )
    model = load_exported_policy(export_dir)
    base = None
    init_from = exported.get("init_from")
    if init_from and (Path(init_from) / "config.json").is_file() and not is_hf_backbone(init_from):
        base = read_lerobot_config(init_from)  # keeps LeRobot's non-architecture fields
    cfg = lerobot_config_for(
        model,
        state_dim=int(feats[STATE_KEY]["shape"][0]),
        action_dim=int(feats[ACTION_KEY]["shape"][0]),
        camera_keys=list(exported.get("cameras") or []),
        base=base,
        normalization=TRAINING_NORMALIZATION,
    )
    save_lerobot_pi05(model, out_dir, cfg)
    save_lerobot_processors(
        out_dir, cfg, {k: stats[k] for k in (STATE_KEY, ACTION_KEY)}, tokenizer=tokenizer
    )
    return Path(out_dir)


def unavailable(cfg: Any, num_datasets: int) -> str | None:
    """Why a run of config ``cfg`` on ``num_datasets`` sub-datasets cannot be written as a
    LeRobot pi0.5 policy (None: it can)."""
    if not getattr(cfg, "state_in_prompt", False):
        return (
            "the byte-level stand-in tokenizer spells no state in the prompt (set "
            "model.tokenizer=<dir> for LeRobot's prompt)"
        )
    if cfg.image.crop_fraction != 1.0:
        return (
            f"the policy crops its frames (image.crop_fraction={cfg.image.crop_fraction}), "
            "LeRobot's pi0.5 does not"
        )
    if num_datasets > 1:
        return (
            f"{num_datasets} sub-datasets, and LeRobot's pi0.5 normaliser holds one set of "
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
    return export_lerobot_pi05(
        export_dir, out_dir, dataset=root, tokenizer=tokenizer, stats=stats[0]
    )


def convert(
    export_dir: Path, out_dir: Path, *, dataset: Path, tokenizer: Path | None = None
) -> Path:
    """The command line's conversion (``--tokenizer``: the tokenizer to ship)."""
    return export_lerobot_pi05(export_dir, out_dir, dataset=dataset, tokenizer=tokenizer)

"""A trained GR00T N1.6 run's native export in the Isaac-GR00T release layout
(``config.json`` + ``model.safetensors`` + ``statistics.json``, ``processor_config.json``
and ``embodiment_id.json``: ``isaac_processor``), or, with a LeRobot groot policy's
backbone, as a LeRobot groot policy (our action head in LeRobot 0.6.1's N1.7 around that
checkpoint's backbone; see ``lerobot_format``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.embodied.data import LeRobotMetadata
from longboat.embodied.models.common.dataset_meta import (
    ACTION_KEY,
    STATE_KEY,
    state_action_features,
)
from longboat.embodied.models.groot_n1_6 import processor
from longboat.embodied.models.groot_n1_6.isaac_format import (
    isaac_config_for,
    read_isaac_config,
    save_isaac_groot,
)
from longboat.embodied.models.groot_n1_6.isaac_processor import (
    Embodiment,
    embodiment_tags,
    joint_groups,
    save_isaac_processor,
)
from longboat.embodied.models.groot_n1_6.lerobot_format import save_lerobot_groot
from longboat.embodied.models.hf_backbones import is_hf_backbone


def run_embodiments(
    root: str | Path,
    cameras: list[str],
    stats: list[dict[str, Any]] | None = None,
) -> list[Embodiment]:
    """The embodiments of a run on ``root`` (one LeRobot dataset or its sub-datasets, in
    ``dataset_roots`` order, embodiment id = position), each with the statistics it was
    normalised with (``stats``; default each ``meta/stats.json``)."""
    from longboat.embodied.train.datasets import dataset_roots

    roots = dataset_roots(Path(root))
    tags = embodiment_tags([r.name for r in roots])
    out = []
    for i, (sub, tag) in enumerate(zip(roots, tags, strict=True)):
        meta = LeRobotMetadata.load(sub)
        widths = {k: int(meta.features[k]["shape"][0]) for k in (STATE_KEY, ACTION_KEY)}
        used = stats[i] if stats is not None else meta.stats
        missing = [k for k in (STATE_KEY, ACTION_KEY) if k not in used]
        if missing:
            raise ConfigError(f"{sub} has no statistics for {missing}", key="--dataset")
        annotation = next(iter((meta.modality or {}).get("annotation") or {}), None)
        out.append(
            Embodiment(
                tag=tag,
                embodiment_id=i,
                groups=joint_groups(meta.modality, widths),
                stats={k: used[k] for k in (STATE_KEY, ACTION_KEY)},
                cameras=list(cameras or meta.video_keys + meta.image_keys),
                language_key=f"annotation.{annotation}" if annotation else "task",
            )
        )
    return out


def export_groot(
    export_dir: str | Path,
    out_dir: str | Path,
    *,
    dataset: str | Path,
    lerobot_backbone: str | Path | None = None,
    embodiments: list[Embodiment] | None = None,
) -> Path:
    """Convert ``export_dir`` (a groot_n1_6 run's export) into the Isaac-GR00T N1.6 layout
    (``config.json`` + ``model.safetensors`` + the processor's statistics files of
    ``embodiments``, default ``run_embodiments(dataset)``), or with ``lerobot_backbone`` (a
    LeRobot groot policy directory) into a LeRobot groot policy with the dataset's min / max
    statistics."""
    from longboat.embodied.train.export import CONFIG_NAME, load_exported_policy

    export_dir, root = Path(export_dir), Path(dataset)
    exported = json.loads((export_dir / CONFIG_NAME).read_text())
    if lerobot_backbone is None:
        model = load_exported_policy(export_dir)
        base = None
        init_from = exported.get("init_from")
        if (
            init_from
            and (Path(init_from) / "config.json").is_file()
            and not is_hf_backbone(init_from)
        ):
            base = read_isaac_config(init_from)  # keeps Isaac-GR00T's non-architecture fields
        isaac_cfg = isaac_config_for(model, base)
        if embodiments is None:
            embodiments = run_embodiments(root, list(exported.get("cameras") or []))
        save_isaac_groot(model, out_dir, isaac_cfg)
        save_isaac_processor(out_dir, isaac_cfg, embodiments)
        return Path(out_dir)
    feats, stats = state_action_features(root)
    return save_lerobot_groot(
        load_exported_policy(export_dir),
        out_dir,
        backbone_from=lerobot_backbone,
        state_dim=int(feats[STATE_KEY]["shape"][0]),
        action_dim=int(feats[ACTION_KEY]["shape"][0]),
        stats={k: stats[k] for k in (STATE_KEY, ACTION_KEY)},
    )


def write_run_export(
    export_dir: Path,
    out_dir: Path,
    *,
    root: Path,
    tokenizer: Path | None,
    cameras: list[str],
    stats: list[dict[str, Any]],
) -> Path:
    """The end of a run: its export in the Isaac layout with the statistics each
    sub-dataset was normalised with, and the run's tokenizer (``model.init_from`` finds it
    there; Isaac-GR00T reads past it)."""
    embodiments = run_embodiments(root, cameras, stats)
    out = export_groot(export_dir, out_dir, dataset=root, embodiments=embodiments)
    if tokenizer is not None:
        processor.copy_tokenizer(tokenizer, out / processor.TOKENIZER_DIR)
    return out


def convert(
    export_dir: Path, out_dir: Path, *, dataset: Path, lerobot_backbone: Path | None = None
) -> Path:
    """The command line's conversion (``--lerobot-backbone``: a LeRobot groot policy)."""
    return export_groot(export_dir, out_dir, dataset=dataset, lerobot_backbone=lerobot_backbone)

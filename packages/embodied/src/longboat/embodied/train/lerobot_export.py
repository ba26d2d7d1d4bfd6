"""A trained run's export in the reference formats: pi0.5 as a LeRobot policy directory,
GR00T N1.6 in the Isaac-GR00T release layout (or, with ``--lerobot-backbone``, as a
LeRobot groot policy: our action head in LeRobot 0.6.1's N1.7 around that checkpoint's
backbone; see ``models/groot_n1_6/lerobot_format.py`` for what that means).

    python -m longboat.embodied.train.lerobot_export <run>/export <out_dir> \\
        --dataset /data/my_lerobot_dataset

writes ``config.json`` + ``model.safetensors`` (LeRobot's names), the processor files with
the dataset's ``meta/stats.json`` and the run's tokenizer in ``tokenizer/`` (the processor
names that folder), so ``PI05Policy.from_pretrained(out_dir)`` and
``make_pre_post_processors(cfg, pretrained_path=out_dir)`` load them. The normaliser is
``MIN_MAX`` for state and action: longboat's training maps both to [-1, 1] with the
dataset's min / max (LeRobot's MIN_MAX formula; longboat also clips to [-1, 1]). A GR00T
run goes out in the Isaac layout with ``statistics.json``, ``processor_config.json`` and
``embodiment_id.json`` (``models/groot_n1_6/isaac_processor.py``). A finished training run
writes the same itself (``export.format``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.embodied.data import LeRobotMetadata
from longboat.embodied.models.groot_n1_6.isaac_processor import (
    Embodiment,
    embodiment_tags,
    joint_groups,
)
from longboat.embodied.models.hf_backbones import is_hf_backbone
from longboat.embodied.models.pi05.lerobot_format import (
    lerobot_config_for,
    read_lerobot_config,
    save_lerobot_pi05,
)
from longboat.embodied.models.pi05.lerobot_processors import save_lerobot_processors
from longboat.embodied.train.export import CONFIG_NAME, load_exported_policy

STATE_KEY, ACTION_KEY = "observation.state", "action"
TRAINING_NORMALIZATION = {"VISUAL": "IDENTITY", "STATE": "MIN_MAX", "ACTION": "MIN_MAX"}
"""How longboat's embodied training normalises (``train/datasets.py``: min_max)."""


def _dataset_meta(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    info_path, stats_path = root / "meta" / "info.json", root / "meta" / "stats.json"
    for path in (info_path, stats_path):
        if not path.is_file():
            raise ConfigError(f"{path} does not exist", key="--dataset", value=str(root))
    return json.loads(info_path.read_text()), json.loads(stats_path.read_text())


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
    export_dir, root = Path(export_dir), Path(dataset)
    exported = json.loads((export_dir / CONFIG_NAME).read_text())
    if exported.get("model_name") != "pi05":
        raise ConfigError(
            f"{export_dir} holds a {exported.get('model_name')!r} policy; LeRobot's format "
            "is written for pi05 here (groot_n1_6: export_groot)",
            key="export_dir",
        )
    info, dataset_stats = _dataset_meta(root)
    stats = dataset_stats if stats is None else stats
    feats = info.get("features", {})
    missing = [k for k in (STATE_KEY, ACTION_KEY) if k not in feats or k not in stats]
    if missing:
        raise ConfigError(f"{root} has no features / stats for {missing}", key="--dataset")
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
    from longboat.embodied.models.groot_n1_6.isaac_format import (
        isaac_config_for,
        read_isaac_config,
        save_isaac_groot,
    )
    from longboat.embodied.models.groot_n1_6.isaac_processor import save_isaac_processor
    from longboat.embodied.models.groot_n1_6.lerobot_format import save_lerobot_groot

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
    info, stats = _dataset_meta(root)
    feats = info.get("features", {})
    missing = [k for k in (STATE_KEY, ACTION_KEY) if k not in feats or k not in stats]
    if missing:
        raise ConfigError(f"{root} has no features / stats for {missing}", key="--dataset")
    return save_lerobot_groot(
        load_exported_policy(export_dir),
        out_dir,
        backbone_from=lerobot_backbone,
        state_dim=int(feats[STATE_KEY]["shape"][0]),
        action_dim=int(feats[ACTION_KEY]["shape"][0]),
        stats={k: stats[k] for k in (STATE_KEY, ACTION_KEY)},
    )


def main(argv: list[str] | None = None) -> None:
    """Command line: export_dir out_dir --dataset root [--lerobot-backbone dir]."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dataset", type=Path, required=True, help="the LeRobot dataset root")
    parser.add_argument(
        "--lerobot-backbone",
        type=Path,
        default=None,
        help="groot_n1_6 only: a LeRobot groot policy whose N1.7 backbone the output keeps",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="pi05 only: the tokenizer directory to ship (default: the run's model.tokenizer)",
    )
    args = parser.parse_args(argv)
    name = json.loads((args.export_dir / CONFIG_NAME).read_text()).get("model_name")
    if name == "groot_n1_6":
        out = export_groot(
            args.export_dir,
            args.out_dir,
            dataset=args.dataset,
            lerobot_backbone=args.lerobot_backbone,
        )
        kind = "LeRobot groot" if args.lerobot_backbone else "Isaac-GR00T N1.6"
        print(f"wrote a {kind} policy to {out}")
        return
    out = export_lerobot_pi05(
        args.export_dir, args.out_dir, dataset=args.dataset, tokenizer=args.tokenizer
    )
    print(f"wrote a LeRobot pi05 policy to {out}")


if __name__ == "__main__":
    main()

"""A trained run's export in the reference formats: pi0.5 as a LeRobot policy directory,
GR00T N1.6 in the Isaac-GR00T release layout (or, with ``--lerobot-backbone``, as a
LeRobot groot policy: our action head in LeRobot 0.6.1's N1.7 around that checkpoint's
backbone; see ``models/groot_n1_6/lerobot_format.py`` for what that means).

    python -m longboat.embodied.train.lerobot_export <run>/export <out_dir> \\
        --dataset /data/my_lerobot_dataset

writes ``config.json`` + ``model.safetensors`` (LeRobot's names) and the processor files
with the dataset's ``meta/stats.json``, so ``PI05Policy.from_pretrained(out_dir)`` and
``make_pre_post_processors(cfg, pretrained_path=out_dir)`` load them. The normaliser is
``MIN_MAX`` for state and action: longboat's training maps both to [-1, 1] with the
dataset's min / max (LeRobot's MIN_MAX formula; longboat also clips to [-1, 1]).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError
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
    export_dir: str | Path, out_dir: str | Path, *, dataset: str | Path
) -> Path:
    """Convert ``export_dir`` (``<output_dir>/export`` of a pi05 run) into a LeRobot policy
    directory ``out_dir``, its normaliser statistics from ``dataset``'s ``meta/stats.json``."""
    export_dir, root = Path(export_dir), Path(dataset)
    exported = json.loads((export_dir / CONFIG_NAME).read_text())
    if exported.get("model_name") != "pi05":
        raise ConfigError(
            f"{export_dir} holds a {exported.get('model_name')!r} policy; LeRobot's format "
            "is written for pi05 here (groot_n1_6: export_groot)",
            key="export_dir",
        )
    info, stats = _dataset_meta(root)
    feats = info.get("features", {})
    missing = [k for k in (STATE_KEY, ACTION_KEY) if k not in feats or k not in stats]
    if missing:
        raise ConfigError(f"{root} has no features / stats for {missing}", key="--dataset")
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
    save_lerobot_processors(out_dir, cfg, {k: stats[k] for k in (STATE_KEY, ACTION_KEY)})
    return Path(out_dir)


def export_groot(
    export_dir: str | Path,
    out_dir: str | Path,
    *,
    dataset: str | Path,
    lerobot_backbone: str | Path | None = None,
) -> Path:
    """Convert ``export_dir`` (a groot_n1_6 run's export) into the Isaac-GR00T N1.6 layout
    (``config.json`` + ``model.safetensors``), or with ``lerobot_backbone`` (a LeRobot groot
    policy directory) into a LeRobot groot policy with the dataset's min / max statistics."""
    from longboat.embodied.models.groot_n1_6.isaac_format import (
        isaac_config_for,
        read_isaac_config,
        save_isaac_groot,
    )
    from longboat.embodied.models.groot_n1_6.lerobot_format import save_lerobot_groot

    export_dir, root = Path(export_dir), Path(dataset)
    exported = json.loads((export_dir / CONFIG_NAME).read_text())
    info, stats = _dataset_meta(root)
    feats = info.get("features", {})
    missing = [k for k in (STATE_KEY, ACTION_KEY) if k not in feats or k not in stats]
    if missing:
        raise ConfigError(f"{root} has no features / stats for {missing}", key="--dataset")
    model = load_exported_policy(export_dir)
    if lerobot_backbone is not None:
        return save_lerobot_groot(
            model,
            out_dir,
            backbone_from=lerobot_backbone,
            state_dim=int(feats[STATE_KEY]["shape"][0]),
            action_dim=int(feats[ACTION_KEY]["shape"][0]),
            stats={k: stats[k] for k in (STATE_KEY, ACTION_KEY)},
        )
    base = None
    init_from = exported.get("init_from")
    if init_from and (Path(init_from) / "config.json").is_file() and not is_hf_backbone(init_from):
        base = read_isaac_config(init_from)  # keeps Isaac-GR00T's non-architecture fields
    return save_isaac_groot(model, out_dir, isaac_config_for(model, base))


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
    out = export_lerobot_pi05(args.export_dir, args.out_dir, dataset=args.dataset)
    print(f"wrote a LeRobot pi05 policy to {out}")


if __name__ == "__main__":
    main()

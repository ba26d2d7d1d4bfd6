"""Find (or generate on first use) the LeRobot dataset of a run and open it for training."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import ConcatDataset, Dataset

from longboat.core.config.errors import ConfigError
from longboat.embodied.config import LeRobotDataConfig
from longboat.embodied.data import (
    EmbodimentSpec,
    LeRobotDataset,
    LeRobotMetadata,
    write_synthetic_dataset,
)
from longboat.embodied.train.policy_batch import ACTION_KEY, STATE_KEY

_DONE = ".longboat_complete"
# Synthetic frame size per model family: what its tiny flavor is specified on.
_SYNTHETIC_IMAGE_HW = {"groot_n1_6": (56, 84), "pi05": (56, 56)}


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def dataset_roots(path: Path) -> list[Path]:
    """One LeRobot root (``meta/info.json`` inside) or its immediate sub-datasets (one per embodiment)."""
    if (path / "meta" / "info.json").is_file():
        return [path]
    roots = sorted(p for p in path.iterdir() if (p / "meta" / "info.json").is_file())
    if not roots:
        raise ConfigError(
            "holds no LeRobot dataset (no meta/info.json in it or its sub-folders)",
            key="data.path",
            value=str(path),
            fix="point data.path at a LeRobot dataset root, or set it to null for synthetic data",
        )
    return roots


def ensure_synthetic(
    data: LeRobotDataConfig, model_name: str, model_cfg: Any, output_dir: Path, is_main: bool
) -> Path:
    """Generate the synthetic dataset into ``<output_dir>/dataset`` once (rank 0), then share it."""
    root = output_dir / "dataset"
    if is_main and not (root / _DONE).exists():
        syn = data.synthetic
        max_state = model_cfg.max_state_dim
        max_action = getattr(model_cfg, "max_action_dim", getattr(model_cfg, "action_dim", 8))
        specs = tuple(
            EmbodimentSpec(
                name=f"robot{i}",
                state_dim=min(max_state, 6 + i),
                action_dim=min(max_action, 5 + i),
            )
            for i in range(syn.num_embodiments)
        )
        tmp = root.with_name(root.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_synthetic_dataset(
            tmp,
            layout=syn.layout,
            num_episodes=syn.num_episodes,
            episode_length=(syn.episode_length, syn.episode_length),
            image_size=_SYNTHETIC_IMAGE_HW.get(model_name, (56, 56)),
            embodiments=specs,
            seed=syn.seed,
        )
        (tmp / _DONE).write_text("ok\n")
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    _barrier()
    return root


def open_dataset(
    data: LeRobotDataConfig, root: Path, horizon: int
) -> tuple[Dataset, list[str], tuple[int, int]]:
    """The training dataset (concatenated over embodiments), its camera keys and frame size.

    Each sample carries an action chunk of ``horizon`` steps (``delta_timestamps``) with
    ``action_is_pad``; state and action are min-max normalised to [-1, 1] from the stats.
    """
    parts: list[LeRobotDataset] = []
    for emb_id, ds_root in enumerate(dataset_roots(root)):
        meta = LeRobotMetadata.load(ds_root)
        fps = meta.fps
        has_column = "embodiment_id" in meta.features
        parts.append(
            LeRobotDataset(
                ds_root,
                delta_timestamps={ACTION_KEY: [k / fps for k in range(horizon)]},
                video_backend=data.video_backend,
                normalization={STATE_KEY: "min_max", ACTION_KEY: "min_max"},
                skip_bad_samples=data.skip_bad_samples,
                embodiment_id=None if has_column else emb_id,
            )
        )
    cams = parts[0].camera_keys
    for p in parts[1:]:
        if p.camera_keys != cams:
            raise ConfigError(
                f"sub-datasets disagree on cameras: {parts[0].root} has {cams}, {p.root} has "
                f"{p.camera_keys}",
                key="data.path",
                value=str(root),
                fix="train on datasets with the same camera keys",
            )
    shape = parts[0].meta.features[cams[0]]["shape"]
    names = parts[0].meta.features[cams[0]].get("names") or []
    hw = (
        (int(shape[0]), int(shape[1]))
        if names[:1] != ["channels"]
        else (int(shape[1]), int(shape[2]))
    )
    dataset: Dataset = parts[0] if len(parts) == 1 else ConcatDataset(parts)
    return dataset, cams, hw

"""Find (or generate on first use) the LeRobot dataset of a run and open it for training."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import ConcatDataset, Dataset

from longboat.core.config.errors import ConfigError
from longboat.embodied.config import LeRobotDataConfig
from longboat.embodied.data import (
    EmbodimentSpec,
    LeRobotDataset,
    LeRobotFormatError,
    LeRobotMetadata,
    write_synthetic_dataset,
)
from longboat.embodied.data.normalize import Normalizer
from longboat.embodied.data.verify import VerifyReport, verify_dataset
from longboat.embodied.models.registry import policy
from longboat.embodied.train.policy_batch import ACTION_KEY, STATE_KEY, feature_limits

_DONE = ".longboat_complete"


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
    """Generate the synthetic dataset into ``<output_dir>/dataset`` once (rank 0), then share
    it: frames of the policy's ``synthetic_image_hw``, state and action within its widths."""
    root = output_dir / "dataset"
    if is_main and not (root / _DONE).exists():
        syn = data.synthetic
        limits = feature_limits(model_name, model_cfg)
        max_state, max_action = limits[STATE_KEY][1], limits[ACTION_KEY][1]
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
            image_size=policy(model_name).synthetic_image_hw,
            embodiments=specs,
            seed=syn.seed,
        )
        (tmp / _DONE).write_text("ok\n")
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    _barrier()
    return root


def held_out_episodes(spec: Any, metas: list[LeRobotMetadata]) -> list[list[int]]:
    """The episode indices ``data.eval_episodes`` holds out of each sub-dataset (empty lists
    when it is null): a fraction f holds out the last ``max(1, round(f * n))`` of a
    sub-dataset's n episodes (by episode index); a list, the listed episodes of every
    sub-dataset that has them. A ConfigError when an index is in no sub-dataset or a
    sub-dataset keeps no training episode."""
    if spec is None:
        return [[] for _ in metas]
    indices = [sorted(ep.index for ep in meta.episodes) for meta in metas]
    if isinstance(spec, int | float) and not isinstance(spec, bool):
        held = [have[len(have) - max(1, round(spec * len(have))) :] for have in indices]
    else:
        wanted = [int(e) for e in spec]
        unknown = [e for e in wanted if not any(e in have for have in indices)]
        if unknown:
            where = ", ".join(
                f"{meta.root}: {have[0]}..{have[-1]}" if have else f"{meta.root}: none"
                for meta, have in zip(metas, indices, strict=True)
            )
            raise ConfigError(
                f"names episodes {unknown} that the dataset does not have (episodes {where})",
                key="data.eval_episodes",
                value=wanted,
                fix="list episodes the dataset has, e.g. "
                f"data.eval_episodes=[{indices[0][-1] if indices[0] else 0}], or give a "
                "fraction such as data.eval_episodes=0.1",
            )
        held = [[e for e in have if e in wanted] for have in indices]
    for meta, have, out in zip(metas, indices, held, strict=True):
        if len(out) >= len(have):
            raise ConfigError(
                f"holds out all {len(have)} episodes of {meta.root}, leaving none to train on",
                key="data.eval_episodes",
                value=spec if not isinstance(spec, list | tuple) else list(spec),
                fix="hold out fewer episodes (a smaller fraction, e.g. data.eval_episodes=0.1, "
                "or fewer indices), or set data.eval_episodes=null",
            )
    return held


@dataclass
class OpenedDataset:
    """The training dataset of a run and what was found while opening it."""

    dataset: Dataset
    """Every sub-dataset (one per embodiment) concatenated, less the held-out episodes."""
    cameras: list[str]
    """Camera keys in batch order (``data.cameras``, or every camera in dataset order)."""
    camera_sizes: dict[str, list[tuple[int, int]]]
    """(height, width) of each camera, one entry per sub-dataset (from info.json)."""
    bad_frames: int = 0
    """Frames skipped for values far outside stats.json (``data.skip_bad_samples``)."""
    verify: VerifyReport | None = None
    """The ``data.verify`` scan (None when off)."""
    eval_dataset: Dataset | None = None
    """The held-out episodes (``data.eval_episodes``) of every sub-dataset, concatenated;
    None without a held-out set."""
    held_out: list[list[int]] = field(default_factory=list)
    """The held-out episode indices of each sub-dataset (in ``dataset_roots`` order)."""
    norm_stats: list[dict[str, Any]] = field(default_factory=list)
    """``{feature: {stat: values}}`` each sub-dataset's state and action are normalised with."""
    stats_from_checkpoint: list[bool] = field(default_factory=list)
    """Per sub-dataset: its statistics came from ``model.init_from`` (not its stats.json)."""

    @property
    def distinct_sizes(self) -> list[tuple[int, int]]:
        """The different camera frame sizes, first seen first."""
        return list(dict.fromkeys(hw for sizes in self.camera_sizes.values() for hw in sizes))


def camera_hw(meta: LeRobotMetadata, key: str) -> tuple[int, int]:
    """(height, width) of camera ``key`` from its info.json shape ([H, W, C] or [C, H, W])."""
    ft = meta.features[key]
    shape, names = ft["shape"], ft.get("names") or []
    if len(shape) != 3:
        raise LeRobotFormatError(
            f"{meta.info_path}: camera {key!r} has shape {shape}; expected [height, width, "
            "channels] (or [channels, height, width] with names)"
        )
    if names[:1] == ["channels"]:
        return int(shape[1]), int(shape[2])
    return int(shape[0]), int(shape[1])


def select_cameras(meta: LeRobotMetadata, wanted: list[str] | None) -> list[str]:
    """``data.cameras`` checked against the dataset (null: every camera in dataset order)."""
    available = meta.video_keys + meta.image_keys
    if wanted is None:
        return available
    unknown = [k for k in wanted if k not in available]
    if unknown or len(set(wanted)) != len(wanted) or not wanted:
        what = (
            f"names cameras {unknown} that {meta.root} does not have"
            if unknown
            else "must name at least one camera, each once"
        )
        raise ConfigError(
            f"{what} (the dataset's cameras: {available})",
            key="data.cameras",
            value=list(wanted),
            fix=f"pick from {available}, e.g. data.cameras=[{','.join(available)}], or set "
            "data.cameras=null for all",
        )
    return list(wanted)


def check_dims(meta: LeRobotMetadata, limits: Mapping[str, tuple[str, int]]) -> None:
    """State / action widths of the dataset against the model's (``feature_limits``): a
    ConfigError naming the feature, its width and the model key to raise."""
    for feature, (model_key, limit) in limits.items():
        ft = meta.features.get(feature)
        if ft is None:
            raise LeRobotFormatError(
                f"{meta.info_path}: no {feature!r} feature (features: {sorted(meta.features)}); "
                f"the policies train on {STATE_KEY!r} and {ACTION_KEY!r}"
            )
        if len(ft["shape"]) != 1:
            raise LeRobotFormatError(
                f"{meta.info_path}: {feature!r} has shape {ft['shape']}; expected [dims]"
            )
        dims = int(ft["shape"][0])
        if dims > limit:
            raise ConfigError(
                f"{feature} of {meta.root} has {dims} dims, more than the model's "
                f"{model_key}={limit}",
                key=f"model.overrides.{model_key}",
                value=limit,
                fix=f"set model.overrides.{model_key}={dims} (or larger)",
            )


def _verify(metas: list[LeRobotMetadata], cameras: list[str], is_main: bool) -> VerifyReport:
    """The ``data.verify`` scan of every sub-dataset, on rank 0 (the other ranks get its
    report, so every rank fails or goes on together)."""
    report = VerifyReport()
    if is_main:
        for meta in metas:
            report.merge(
                verify_dataset(meta, video_keys=[k for k in cameras if k in meta.video_keys])
            )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [report]
        dist.broadcast_object_list(box, src=0)
        report = box[0]
    return report


def open_dataset(
    data: LeRobotDataConfig,
    root: Path,
    horizon: int,
    *,
    limits: Mapping[str, tuple[str, int]] | None = None,
    max_cameras: int | None = None,
    is_main: bool = True,
    stats_for: Any = None,
) -> OpenedDataset:
    """The training dataset (concatenated over embodiments, less the held-out episodes of
    ``data.eval_episodes``, which form ``eval_dataset``), checked before any model is built:
    cameras (``data.cameras``), state/action widths against ``limits`` (``feature_limits``),
    at most ``max_cameras`` cameras, the held-out set, every file with ``data.verify``.

    Each sample carries an action chunk of ``horizon`` steps (``delta_timestamps``) with
    ``action_is_pad``; state and action are min-max normalised to [-1, 1] from the stats:
    ``stats_for(index, names, meta)`` (a checkpoint's for sub-dataset ``index`` of those
    named ``names``, ``reference_formats``) where it gives some, else the sub-dataset's
    ``meta/stats.json``.
    """
    roots = dataset_roots(root)
    metas = [LeRobotMetadata.load(r) for r in roots]
    cams = select_cameras(metas[0], data.cameras)
    for meta in metas[1:]:
        theirs = select_cameras(meta, data.cameras)
        if theirs != cams:
            raise ConfigError(
                f"sub-datasets disagree on cameras: {metas[0].root} has {cams}, {meta.root} "
                f"has {theirs}",
                key="data.path",
                value=str(root),
                fix="train on datasets with the same camera keys, or pick shared ones with "
                "data.cameras",
            )
    if max_cameras is not None and len(cams) > max_cameras:
        raise ConfigError(
            f"selects {len(cams)} cameras ({cams}) but the model takes {max_cameras}",
            key="data.cameras",
            value=data.cameras,
            fix=f"pick {max_cameras} with data.cameras=[...], or raise "
            f"model.overrides.num_cameras={len(cams)}",
        )
    for meta in metas:
        check_dims(meta, limits or {})
    sizes = {key: [camera_hw(meta, key) for meta in metas] for key in cams}
    held = held_out_episodes(data.eval_episodes, metas)
    report = _verify(metas, cams, is_main) if data.verify else None
    if report is not None:
        report.raise_if_problems()
    parts: list[LeRobotDataset] = []
    eval_parts: list[LeRobotDataset] = []
    norm_stats, from_checkpoint = [], []
    modes = {STATE_KEY: "min_max", ACTION_KEY: "min_max"}
    names = [r.name for r in roots]
    for emb_id, (ds_root, meta, out) in enumerate(zip(roots, metas, held, strict=True)):
        given = stats_for(emb_id, names, meta) if stats_for is not None else None
        used = (
            dict(given)
            if given is not None
            else {k: meta.stats[k] for k in modes if k in meta.stats}
        )
        norm_stats.append(used)
        from_checkpoint.append(given is not None)
        part = dict(
            delta_timestamps={ACTION_KEY: [k / meta.fps for k in range(horizon)]},
            video_backend=data.video_backend,
            camera_keys=cams,
            normalization=Normalizer(used, modes) if given is not None else modes,
            skip_bad_samples=data.skip_bad_samples,
            embodiment_id=None if "embodiment_id" in meta.features else emb_id,
            # uint8 to the device (a quarter of float32's bytes); the policy scales them.
            image_dtype="uint8",
        )
        # Both parts normalise with the whole dataset's stats.json, as the policy will.
        keep = [ep.index for ep in meta.episodes if ep.index not in out] if out else None
        parts.append(LeRobotDataset(ds_root, episodes=keep, **part))
        if out:
            eval_parts.append(LeRobotDataset(ds_root, episodes=out, **part))
    return OpenedDataset(
        _concat(parts),
        cams,
        sizes,
        bad_frames=sum(p.bad_frames for p in parts + eval_parts),
        verify=report,
        eval_dataset=_concat(eval_parts) if eval_parts else None,
        held_out=held,
        norm_stats=norm_stats,
        stats_from_checkpoint=from_checkpoint,
    )


def _concat(parts: list[LeRobotDataset]) -> Dataset:
    return parts[0] if len(parts) == 1 else ConcatDataset(parts)

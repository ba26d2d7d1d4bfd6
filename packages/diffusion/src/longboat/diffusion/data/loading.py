"""One call from a data config to a resumable loader of model-ready latent batches."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from longboat.diffusion.data.batching import LatentBatchSampler, collate_latents
from longboat.diffusion.data.dataset import LatentDataset
from longboat.diffusion.data.schema import LatentsDataConfig, SyntheticSquaresDataConfig

__all__ = ["LatentLoader", "build_latent_loader", "dataset_paths", "eval_dataset_paths"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LatentLoader:
    """A dataset, its batch sampler (``state_dict`` / ``load_state_dict`` resume it) and a
    ``DataLoader`` yielding :func:`~longboat.diffusion.data.batching.collate_latents` batches."""

    dataset: LatentDataset
    sampler: LatentBatchSampler
    loader: torch.utils.data.DataLoader
    packed: bool
    """Batches hold a list of latents (``batching=pack``) rather than one padded tensor."""

    def state_dict(self) -> dict[str, Any]:
        """The batch position (save it with the checkpoint)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a saved position."""
        self.sampler.load_state_dict(state)


def dataset_paths(cfg: LatentsDataConfig, prefix: str = "data") -> list[Path]:
    """The dataset directories ``cfg`` reads (the synthetic set is written first if needed)."""
    if isinstance(cfg, SyntheticSquaresDataConfig):
        from longboat.diffusion.data.synthetic import generate_squares

        return [generate_squares(cfg, prefix=prefix)]
    return [Path(p) for p in cfg.paths] + ([Path(cfg.path)] if cfg.path else [])


def eval_dataset_paths(cfg: LatentsDataConfig, prefix: str = "data") -> list[Path]:
    """The held-out dataset directories of ``cfg``: ``eval_paths``, or the synthetic set's
    held-out set (written first if needed); empty when there is none."""
    if isinstance(cfg, SyntheticSquaresDataConfig):
        from longboat.diffusion.data.synthetic import eval_set_config, generate_squares

        held_out = eval_set_config(cfg)
        return [] if held_out is None else [generate_squares(held_out, prefix=prefix)]
    return [Path(p) for p in cfg.eval_paths]


def build_latent_loader(
    cfg: LatentsDataConfig,
    *,
    batch_size: int,
    num_replicas: int | None = None,
    rank: int | None = None,
    prefix: str = "data",
    pin_memory: bool = False,
) -> LatentLoader:
    """Open ``cfg``'s datasets and batch them for one data-parallel rank.

    ``batch_size``: samples per micro-batch (``bucket``). Worker processes
    (``cfg.num_workers``) prefetch, so with workers the saved position runs ahead of what the
    loop consumed by the prefetched batches (see core's sampler). ``pin_memory``: the
    loader's thread pins each batch (for a device whose copies want pinned memory, core's
    ``pins_host_memory``), so the step's copy starts at once.
    """
    cfg.validate(prefix)
    dataset = LatentDataset(
        dataset_paths(cfg, prefix), verify=cfg.verify, skip_bad_samples=cfg.skip_bad_samples
    )
    packed = cfg.batching == "pack"
    sampler = LatentBatchSampler(
        dataset.shapes,
        batch_size=batch_size,
        mode=cfg.batching,
        max_tokens=cfg.max_tokens,
        patch_size=tuple(cfg.patch_size),
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        drop_last=cfg.drop_last,
        num_replicas=num_replicas,
        rank=rank,
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=partial(collate_latents, packed=packed, dtype=_DTYPES[cfg.dtype]),
        num_workers=cfg.num_workers,
        pin_memory=pin_memory,
    )
    return LatentLoader(dataset=dataset, sampler=sampler, loader=loader, packed=packed)

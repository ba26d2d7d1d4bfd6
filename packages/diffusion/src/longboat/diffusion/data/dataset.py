"""Reading latent datasets (see :mod:`~longboat.diffusion.data.shards` for the format).

:class:`LatentDataset` is map-style: ``dataset[i]`` reads sample ``i`` from its shard. The
shapes and text lengths come from the manifest, so batches are planned (bucketing, packing)
without opening a shard. Corruption — a missing or truncated shard, a shard whose checksum or
contents disagree with the manifest, a NaN / Inf in a sample, a shard path outside its dataset
folder — raises :class:`~longboat.diffusion.data.errors.DataError` naming the shard and the
sample, when the dataset is opened (checksums and values are checked once per shard version,
see :mod:`~longboat.diffusion.data.integrity`).
"""

from __future__ import annotations

import bisect
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longboat.diffusion.data.errors import DataError
from longboat.diffusion.data.integrity import check_shards
from longboat.diffusion.data.shards import (
    DTYPES,
    ShardInfo,
    read_manifest,
    shard_infos,
)

__all__ = ["LatentDataset"]


def _inside(root: Path, file: str, where: str) -> None:
    """``DataError`` unless shard ``file`` of the manifest resolves inside ``root``."""
    base = os.path.abspath(root)
    target = os.path.abspath(root / file)
    if os.path.commonpath([base, target]) != base:
        raise DataError(
            f"{where}: shard file {file!r} resolves to {target}, outside the dataset folder "
            f"{base}; a manifest lists only files inside its own folder (a damaged or crafted "
            "manifest)"
        )


class LatentDataset(torch.utils.data.Dataset):
    """Samples of one or more latent dataset directories, in order.

    ``dataset[i]`` is a dict: ``latents`` ``[C, T, H, W]`` and ``text_embeds`` ``[L, D]`` (the
    stored dtype), ``caption`` (str), ``metadata`` (dict: source, fps, frames, height, width)
    and ``index`` (``i``).

    Every shard's SHA-256 and values (no NaN / Inf) are checked when the dataset is opened;
    the result is cached per shard file, size and mtime, so an unchanged dataset is read only
    the first time.

    Args:
        paths: dataset directories (their samples are concatenated in the order given).
        verify: check every shard now even when an unchanged shard's check is cached (reads
            every byte).
        allow_incomplete: read the finished shards of a preparation that has not finished
            (otherwise that is an error).
        skip_bad_samples: leave out (and count, in ``skipped``) samples holding NaN / Inf
            instead of refusing the dataset.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        verify: bool = False,
        allow_incomplete: bool = False,
        skip_bad_samples: bool = False,
    ) -> None:
        roots = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
        if not roots:
            raise DataError("LatentDataset needs at least one dataset directory")
        self.roots = roots
        self.manifests = [read_manifest(r) for r in roots]
        first = self.manifests[0]
        self.latent_channels = int(first["latent_channels"])
        self.text_dim = int(first["text_dim"])
        self.pooled_dim = int(first.get("pooled_dim", 0))
        """Width of each sample's ``pooled_embeds`` (0: the dataset has none)."""
        self._shards: list[tuple[Path, ShardInfo, torch.dtype]] = []
        for root, m in zip(roots, self.manifests, strict=True):
            where = str(root / "manifest.json")
            if not m["complete"] and not allow_incomplete:
                raise DataError(
                    f"{root}: the preparation has not finished ({m.get('num_samples', 0)} "
                    "samples in finished shards); run the same `data prepare` again to finish "
                    "it (it resumes), or read it anyway with allow_incomplete"
                )
            if (int(m["latent_channels"]), int(m["text_dim"]), int(m.get("pooled_dim", 0))) != (
                self.latent_channels,
                self.text_dim,
                self.pooled_dim,
            ):
                raise DataError(
                    f"{root}: latents of {m['latent_channels']} channels and text of dim "
                    f"{m['text_dim']}, but {roots[0]} has {self.latent_channels} / "
                    f"{self.text_dim}: datasets read together need the same encoders"
                )
            for info in shard_infos(m, where):
                _inside(root, info.file, where)
                self._shards.append((root, info, DTYPES[m["dtype"]]))
        self._starts = np.cumsum([0] + [s.num_samples for _, s, _ in self._shards]).tolist()
        if self._starts[-1] == 0:
            raise DataError(f"{', '.join(map(str, roots))}: the dataset holds no samples")
        self._open: tuple[int, Any] | None = None
        for k in range(len(self._shards)):
            self._check_file(k)
        bad = self._check_contents(force=verify)
        self.skipped: list[str] = []
        """Samples left out for NaN / Inf values (``skip_bad_samples``), each named."""
        self._keep: np.ndarray | None = None
        if bad:
            named = [f"{self._where(k, j)}: {tensor} holds NaN or Inf" for k, j, tensor in bad]
            if not skip_bad_samples:
                more = f" (and {len(named) - 3} more)" if len(named) > 3 else ""
                raise DataError(
                    f"{'; '.join(named[:3])}{more}. Prepare those samples again, or set "
                    "data.skip_bad_samples=true to leave them out (they are counted)"
                )
            self.skipped = named
            dropped = {self._starts[k] + j for k, j, _ in bad}
            self._keep = np.asarray(
                [i for i in range(self._starts[-1]) if i not in dropped], dtype=np.int64
            )
            if self._keep.size == 0:
                raise DataError(f"{named[0]}: every sample of the dataset holds NaN or Inf")
            warnings.warn(
                f"data.skip_bad_samples: left out {len(dropped)} sample(s) holding NaN or Inf: "
                f"{'; '.join(named[:3])}{' ...' if len(named) > 3 else ''}",
                UserWarning,
                stacklevel=2,
            )
        shapes = np.asarray(
            [shp for _, s, _ in self._shards for shp in s.latent_shapes], dtype=np.int64
        ).reshape(-1, 3)
        lengths = np.asarray([n for _, s, _ in self._shards for n in s.text_lengths], np.int64)
        self.shapes = shapes if self._keep is None else shapes[self._keep]
        """``[N, 3]``: each sample's latent ``(T, H, W)``."""
        self.text_lengths = lengths if self._keep is None else lengths[self._keep]
        """``[N]``: each sample's number of text tokens."""

    def empty_caption(self) -> torch.Tensor | None:
        """The empty caption's text embedding ``[L, D]`` of the first directory (None when a
        directory has none: prepared before datasets carried it)."""
        from longboat.diffusion.data.empty_caption import read_empty_caption

        found = [read_empty_caption(r) for r in self.roots]
        return None if any(e is None for e in found) else found[0]

    def __len__(self) -> int:
        return int(self._starts[-1]) if self._keep is None else int(self._keep.size)

    @property
    def num_bytes(self) -> int:
        """Bytes of all shards."""
        return sum(s.bytes for _, s, _ in self._shards)

    def lengths(self, patch_size: Sequence[int] = (1, 2, 2)) -> np.ndarray:
        """Tokens per sample for a model that patchifies latents by ``patch_size`` (t, h, w)."""
        p = np.asarray(patch_size, dtype=np.int64)
        return np.prod(-(-self.shapes // p), axis=1)

    def _where(self, k: int, j: int | None = None) -> str:
        root, info, _ = self._shards[k]
        at = f"{root / info.file}"
        return at if j is None else f"{at} sample {j} (dataset index {self._starts[k] + j})"

    def _check_contents(self, *, force: bool) -> list[tuple[int, int, str]]:
        """Compare every shard's SHA-256 with the manifest's (``DataError`` naming the shard);
        returns ``(shard, sample, tensor)`` of every tensor holding NaN or Inf."""
        bad: list[tuple[int, int, str]] = []
        for root in dict.fromkeys(r for r, _, _ in self._shards):
            ks = [k for k, (r, _, _) in enumerate(self._shards) if r == root]
            checks = check_shards(root, [self._shards[k][1].file for k in ks], force=force)
            for k in ks:
                info = self._shards[k][1]
                check = checks[info.file]
                if check.sha256 != info.sha256:
                    raise DataError(
                        f"{root / info.file}: SHA-256 differs from the manifest's (corrupt); "
                        "prepare it again"
                    )
                bad += [(k, j, tensor) for j, tensor in check.nonfinite]
        return bad

    def _check_file(self, k: int) -> None:
        root, info, _ = self._shards[k]
        path = root / info.file
        if not path.is_file():
            raise DataError(
                f"{path}: missing, but the manifest lists it; restore the file or prepare the "
                "dataset again"
            )
        size = path.stat().st_size
        if size != info.bytes:
            raise DataError(
                f"{path}: {size} bytes, the manifest says {info.bytes} (truncated or replaced); "
                "prepare the dataset again"
            )

    def _handle(self, k: int) -> Any:
        from safetensors import safe_open

        if self._open is not None and self._open[0] == k:
            return self._open[1]
        root, info, _ = self._shards[k]
        try:
            handle = safe_open(str(root / info.file), framework="pt")
            samples = json.loads((handle.metadata() or {})["samples"])
        except FileNotFoundError:
            self._check_file(k)
            raise
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise DataError(
                f"{self._where(k)}: not a readable safetensors shard ({exc}); prepare the "
                "dataset again"
            ) from None
        if len(samples) != info.num_samples:
            raise DataError(
                f"{self._where(k)}: holds metadata of {len(samples)} samples, the manifest "
                f"lists {info.num_samples}"
            )
        self._open = (k, (handle, samples))
        return self._open[1]

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard, sample in shard)`` of dataset sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside [0, {len(self)})")
        if self._keep is not None:
            index = int(self._keep[index])
        k = bisect.bisect_right(self._starts, index) - 1
        return k, index - self._starts[k]

    def __getitem__(self, index: int) -> dict[str, Any]:
        k, j = self.locate(int(index))
        _, info, dtype = self._shards[k]
        handle, samples = self._handle(k)
        try:
            latents = handle.get_tensor(f"{j}.latents")
            text = handle.get_tensor(f"{j}.text_embeds")
        except Exception as exc:
            raise DataError(
                f"{self._where(k, j)}: cannot be read ({exc}); prepare the dataset again"
            ) from None
        expect = (self.latent_channels, *info.latent_shapes[j])
        if tuple(latents.shape) != expect or latents.dtype != dtype:
            raise DataError(
                f"{self._where(k, j)}: latents {tuple(latents.shape)} {latents.dtype}, the "
                f"manifest says {expect} {dtype}"
            )
        if tuple(text.shape) != (info.text_lengths[j], self.text_dim) or text.dtype != dtype:
            raise DataError(
                f"{self._where(k, j)}: text_embeds {tuple(text.shape)} {text.dtype}, the "
                f"manifest says ({info.text_lengths[j]}, {self.text_dim}) {dtype}"
            )
        for name, tensor in (("latents", latents), ("text_embeds", text)):
            if not bool(torch.isfinite(tensor).all()):  # the shard changed since it was opened
                raise DataError(
                    f"{self._where(k, j)}: {name} holds NaN or Inf; prepare it again, or set "
                    "data.skip_bad_samples=true to leave such samples out"
                )
        meta = dict(samples[j])
        caption = str(meta.pop("caption", ""))
        if self.pooled_dim:
            extra = {"pooled_embeds": handle.get_tensor(f"{j}.pooled_embeds")}
        else:
            extra = {}
        return {
            **extra,
            "latents": latents,
            "text_embeds": text,
            "caption": caption,
            "metadata": meta,
            "index": int(index),
        }

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers re-open shards themselves (safetensors handles do not pickle).
        state = dict(self.__dict__)
        state["_open"] = None
        return state

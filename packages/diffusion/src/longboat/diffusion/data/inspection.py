"""``data inspect``: what a latent dataset holds (counts, shapes, bytes, a few captions)."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

from longboat.diffusion.data.dataset import LatentDataset
from longboat.diffusion.data.shards import read_manifest

__all__ = ["inspect_dataset"]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def inspect_dataset(
    path: str | Path, *, captions: int = 3, verify: bool = False, patch_size=(1, 2, 2)
) -> str:
    """A human summary of the dataset at ``path`` (samples holding NaN / Inf are listed);
    ``verify`` checks every shard's SHA-256 again and reads every sample."""
    manifest = read_manifest(path)
    with warnings.catch_warnings():  # samples holding NaN / Inf are listed below instead
        warnings.simplefilter("ignore", UserWarning)
        ds = LatentDataset(path, verify=verify, allow_incomplete=True, skip_bad_samples=True)
    state = "complete" if manifest["complete"] else "NOT complete (re-run prepare to finish)"
    lines = [
        f"{path}: {len(ds):,} samples in {manifest['num_shards']:,} shards, "
        f"{_mib(ds.num_bytes)} ({manifest['dtype']}), {state}",
        f"latents: {ds.latent_channels} channels; text embeddings: dim {ds.text_dim}",
    ]
    enc = manifest.get("encoders", {})
    if enc:
        lines.append(
            "encoders: "
            + "; ".join(
                f"{k}: {v.get('class', v) if isinstance(v, dict) else v}" for k, v in enc.items()
            )
        )
    src = manifest.get("sources")
    if src:
        lines.append(
            f"inputs: {src['done']:,} of {src['total']:,} done, {len(src['skipped']):,} skipped"
        )
    if ds.skipped:
        lines.append(
            f"samples holding NaN / Inf (left out above; training refuses them unless "
            f"data.skip_bad_samples=true): {len(ds.skipped):,}"
        )
        lines += [f"  {name}" for name in ds.skipped[:5]]
        if len(ds.skipped) > 5:
            lines.append(f"  ... {len(ds.skipped) - 5} more")
    tokens = ds.lengths(patch_size)
    lines.append(
        f"model tokens per sample (patch {'x'.join(map(str, patch_size))}): min {tokens.min():,}, "
        f"mean {tokens.mean():,.0f}, max {tokens.max():,}; text tokens: min "
        f"{ds.text_lengths.min()}, mean {ds.text_lengths.mean():.1f}, max {ds.text_lengths.max()}"
    )
    shapes = Counter(tuple(int(v) for v in s) for s in ds.shapes)
    lines.append("latent shapes [T, H, W] (samples):")
    for shape, n in sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0]))[:12]:
        lines.append(f"  {list(shape)}: {n:,}")
    if len(shapes) > 12:
        lines.append(f"  ... {len(shapes) - 12} more shapes")
    if verify:
        for i in range(len(ds)):
            ds[i]
        lines.append(f"verified: every shard's SHA-256 and all {len(ds):,} samples read")
    if captions:
        lines.append("captions:")
        for i in range(min(captions, len(ds))):
            s = ds[i]
            lines.append(f"  [{i}] {s['metadata'].get('source', '')}: {s['caption']!r}")
    return "\n".join(lines)

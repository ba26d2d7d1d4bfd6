"""Qwen2.5-VL vision tower (ViT) configuration: dataclass, HF reading/writing, flavors."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Qwen25VisionConfig:
    """Shape of the Qwen2.5-VL ViT: patch embedding, window/full attention blocks, merger."""

    depth: int
    """Number of transformer blocks."""
    hidden_size: int
    """Width of the blocks."""
    intermediate_size: int
    """SwiGLU inner width of each block's MLP."""
    num_heads: int
    """Attention heads (multi-head; no grouped KV)."""
    out_hidden_size: int
    """Width of the merger output (the language model's hidden size)."""
    patch_size: int = 14
    """Spatial patch side in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """The merger joins ``spatial_merge_size**2`` neighbouring patches into one token."""
    window_size: int = 112
    """Side in pixels of the attention windows of the non-full-attention blocks."""
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    """Blocks (0-based) attending over the whole frame instead of a window."""
    in_channels: int = 3
    """Image channels."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon of the blocks and the merger."""
    rope_theta: float = 10000.0
    """Base of the 2D axial rotary embedding."""
    hidden_act: str = "silu"
    """Gate activation of the block MLPs (Qwen2.5-VL: silu)."""

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: ``in_channels * temporal_patch_size * patch_size**2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per merged token."""
        return self.spatial_merge_size**2

    @property
    def window_merged(self) -> int:
        """Window side in merged tokens."""
        return self.window_size // (self.spatial_merge_size * self.patch_size)

    def validate(self, *, prefix: str = "model.vision") -> None:
        """Raise ``ValueError`` naming every inconsistent key and its fix."""
        problems: list[str] = []
        for key in (
            "depth",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "out_hidden_size",
            "patch_size",
            "temporal_patch_size",
            "spatial_merge_size",
            "window_size",
            "in_channels",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{prefix}.{key}={value!r}: must be a positive integer.")
        if problems:
            raise ValueError("; ".join(problems))
        if self.hidden_size % self.num_heads:
            problems.append(
                f"{prefix}.num_heads={self.num_heads} does not divide hidden_size="
                f"{self.hidden_size}. Fix: pick a divisor."
            )
        elif self.head_dim % 4:
            problems.append(
                f"{prefix}.hidden_size/num_heads={self.head_dim}: the 2D axial rotary embedding "
                "needs a head dim divisible by 4. Fix: change hidden_size or num_heads."
            )
        tile = self.patch_size * self.spatial_merge_size
        if self.window_size % tile:
            problems.append(
                f"{prefix}.window_size={self.window_size} is not a multiple of patch_size * "
                f"spatial_merge_size = {tile}. Fix: use a multiple of {tile}."
            )
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            problems.append(
                f"{prefix}.fullatt_block_indexes has {bad} outside 0..{self.depth - 1}. "
                "Fix: list block indexes below depth."
            )
        if self.hidden_act != "silu":
            problems.append(
                f"{prefix}.hidden_act={self.hidden_act!r}: only 'silu' (SwiGLU) is implemented."
            )
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any] | Any) -> Qwen25VisionConfig:
        """Read the ``vision_config`` of an HF ``Qwen2_5_VLConfig`` (a dict or config object)."""
        d = dict(vision_config if isinstance(vision_config, Mapping) else vision_config.to_dict())
        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        in_channels = d.get("in_channels", d.get("in_chans", 3))
        cfg = cls(
            depth=int(d["depth"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_heads=int(d["num_heads"]),
            out_hidden_size=int(d["out_hidden_size"]),
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            window_size=int(d.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in d.get("fullatt_block_indexes", ())),
            in_channels=int(in_channels),
            rope_theta=float(theta),
            hidden_act=str(d.get("hidden_act", "silu")),
        )
        cfg.validate(prefix="vision_config")
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` dict ``transformers``' ``Qwen2_5_VLVisionConfig`` takes."""
        return {
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "out_hidden_size": self.out_hidden_size,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "window_size": self.window_size,
            "fullatt_block_indexes": list(self.fullatt_block_indexes),
            "in_channels": self.in_channels,
            "hidden_act": self.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }

    def replace(self, **changes: Any) -> Qwen25VisionConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def _released(out_hidden_size: int) -> Qwen25VisionConfig:
    # Every released Qwen2.5-VL shares this ViT; only the merger's output width differs.
    return Qwen25VisionConfig(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=out_hidden_size,
    )


VISION_FLAVORS: dict[str, Qwen25VisionConfig] = {
    "3b": _released(2048),
    "7b": _released(3584),
    "32b": _released(5120),
    "72b": _released(8192),
    "tiny": Qwen25VisionConfig(
        depth=4,
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        out_hidden_size=48,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        window_size=16,
        fullatt_block_indexes=(1, 3),
    ),
}
"""Vision towers of the released Qwen2.5-VL sizes and a CPU-sized ``tiny``."""


def vision_flavor(name: str) -> Qwen25VisionConfig:
    """The vision config of flavor ``name`` (``3b``, ``7b``, ``32b``, ``72b``, ``tiny``)."""
    try:
        return VISION_FLAVORS[name]
    except KeyError:
        raise ValueError(
            f"Qwen2.5-VL vision flavor {name!r} is unknown; choose one of {sorted(VISION_FLAVORS)}."
        ) from None

"""Qwen3-VL vision tower (ViT) configuration: dataclass, HF reading / writing, flavors.

Pure Python (no torch): a run's model config becomes one of these before anything is built.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from longboat.core.config.errors import ConfigError

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
"""MLP activations the tower implements (the released towers use the tanh approximation)."""


@dataclass(frozen=True, kw_only=True)
class Qwen3VisionConfig:
    """Shape of the Qwen3-VL ViT: patch embedding + learned positions resampled to each grid,
    LayerNorm / GELU blocks with 2D rotary and full attention per frame, the patch merger and
    the deepstack mergers."""

    depth: int
    """Number of transformer blocks."""
    hidden_size: int
    """Width of the blocks."""
    intermediate_size: int
    """MLP inner width (a plain GELU MLP, not gated)."""
    num_heads: int
    """Attention heads (multi-head; no grouped KV)."""
    out_hidden_size: int
    """Width of the mergers' output (the language model's hidden size)."""
    deepstack_visual_indexes: tuple[int, ...]
    """Blocks (0-based) whose output a deepstack merger turns into features that are added
    to the decoder's hidden states after decoder layer 0, 1, ... (in this order)."""
    num_position_embeddings: int = 2304
    """Rows of the learned position table, a square grid (48 x 48) resampled bilinearly to
    each image's patch grid."""
    patch_size: int = 16
    """Spatial patch side in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """The mergers join ``spatial_merge_size**2`` neighbouring patches into one token."""
    in_channels: int = 3
    """Image channels."""
    norm_eps: float = 1e-6
    """LayerNorm epsilon of the blocks and the mergers."""
    rope_theta: float = 10000.0
    """Base of the 2D axial rotary embedding."""
    hidden_act: str = "gelu_pytorch_tanh"
    """MLP activation (``gelu_pytorch_tanh`` or ``gelu``)."""

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
    def position_grid(self) -> int:
        """Side of the learned position table."""
        return math.isqrt(self.num_position_embeddings)

    def validate(self, *, prefix: str = "model.vision") -> None:
        """Raise ``ConfigError`` naming every inconsistent key and its fix."""
        problems: list[str] = []
        for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                    "num_position_embeddings", "patch_size", "temporal_patch_size",
                    "spatial_merge_size", "in_channels"):  # fmt: skip
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{prefix}.{key}={value!r}: must be a positive integer")
        if problems:
            raise ConfigError("; ".join(problems))
        if self.hidden_size % self.num_heads:
            problems.append(
                f"{prefix}.num_heads={self.num_heads} does not divide hidden_size="
                f"{self.hidden_size}; pick a divisor"
            )
        elif self.head_dim % 4:
            problems.append(
                f"{prefix}.hidden_size/num_heads={self.head_dim}: the 2D axial rotary embedding "
                "needs a head dim divisible by 4; change hidden_size or num_heads"
            )
        if self.position_grid**2 != self.num_position_embeddings:
            problems.append(
                f"{prefix}.num_position_embeddings={self.num_position_embeddings}: must be a "
                "square (the table is a square grid of positions)"
            )
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            problems.append(
                f"{prefix}.deepstack_visual_indexes has {bad} outside 0..{self.depth - 1}; "
                "list block indexes below depth"
            )
        if len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            problems.append(f"{prefix}.deepstack_visual_indexes: an index is listed twice")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(
                f"{prefix}.hidden_act={self.hidden_act!r}: only {list(ACTIVATIONS)} are implemented"
            )
        if problems:
            raise ConfigError("; ".join(problems))

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any] | Any) -> Qwen3VisionConfig:
        """Read the ``vision_config`` of an HF ``Qwen3VLConfig`` (a dict or config object)."""
        d = dict(vision_config if isinstance(vision_config, Mapping) else vision_config.to_dict())
        rope = d.get("rope_parameters") or {}
        cfg = cls(
            depth=int(d["depth"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_heads=int(d["num_heads"]),
            out_hidden_size=int(d["out_hidden_size"]),
            deepstack_visual_indexes=tuple(int(i) for i in d.get("deepstack_visual_indexes", ())),
            num_position_embeddings=int(d.get("num_position_embeddings", 2304)),
            patch_size=int(d.get("patch_size", 16)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            in_channels=int(d.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            hidden_act=str(d.get("hidden_act", "gelu_pytorch_tanh")),
        )
        cfg.validate(prefix="vision_config")
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` dict ``transformers``' ``Qwen3VLVisionConfig`` takes."""
        return {
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "out_hidden_size": self.out_hidden_size,
            "deepstack_visual_indexes": list(self.deepstack_visual_indexes),
            "num_position_embeddings": self.num_position_embeddings,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "in_channels": self.in_channels,
            "hidden_act": self.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }

    def replace(self, **changes: Any) -> Qwen3VisionConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


# The towers of the released dense checkpoints (their config.json ``vision_config``): 2B and
# 4B share a 24-block tower, 8B has a 27-block one; only the mergers' width differs.
_SMALL = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
              deepstack_visual_indexes=(5, 11, 17))  # fmt: skip
_LARGE = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
              deepstack_visual_indexes=(8, 16, 24))  # fmt: skip

VISION_FLAVORS: dict[str, Qwen3VisionConfig] = {
    "2b": Qwen3VisionConfig(**_SMALL, out_hidden_size=2048),
    "4b": Qwen3VisionConfig(**_SMALL, out_hidden_size=2560),
    "8b": Qwen3VisionConfig(**_LARGE, out_hidden_size=4096),
    "tiny": Qwen3VisionConfig(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        deepstack_visual_indexes=(0, 1),
        num_position_embeddings=16,
        patch_size=4,
    ),
}
"""Vision towers of the released Qwen3-VL dense sizes and a CPU-sized ``tiny``."""


def vision_flavor(name: str) -> Qwen3VisionConfig:
    """The vision config of flavor ``name`` (``2b``, ``4b``, ``8b``, ``tiny``)."""
    if name not in VISION_FLAVORS:
        raise ConfigError(
            f"Qwen3-VL vision flavor {name!r} is unknown",
            fix=f"choose one of {sorted(VISION_FLAVORS)}",
        )
    return VISION_FLAVORS[name]

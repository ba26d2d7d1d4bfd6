"""SigLIP vision tower configuration: dataclass, HF reading / writing, flavors.

Pure Python (no torch): the run config's ``model.vision`` section becomes one of these
before anything is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from longboat.core.config.errors import ConfigError

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
"""MLP activations the tower implements (SigLIP uses the tanh approximation)."""


@dataclass(frozen=True, kw_only=True)
class SiglipVisionConfig:
    """Shape of a SigLIP ViT: conv patch embedding + learned positions, pre-LayerNorm blocks
    (multi-head attention, GELU MLP, biases everywhere)."""

    name: str = "siglip"
    """Tower kind (the ``model/vision`` option's ``name``)."""
    hidden_size: int
    """Width of the blocks."""
    intermediate_size: int
    """MLP inner width."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Attention heads."""
    image_size: int
    """Side of the square input crop in pixels."""
    patch_size: int
    """Side of a patch in pixels."""
    in_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def depth(self) -> int:
        """Blocks (the name other towers use)."""
        return self.num_layers

    @property
    def grid(self) -> int:
        """Patches per side of one crop (the strided conv drops a remainder: 384 / 14 -> 27)."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        """Tokens per crop."""
        return self.grid**2

    def validate(self, *, prefix: str = "model.vision") -> None:
        """Raise ``ConfigError`` naming every inconsistent key."""
        problems = []
        ints = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "image_size",
                "patch_size", "in_channels")  # fmt: skip
        for key in ints:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{prefix}.{key}={value!r}: must be a positive integer")
        if problems:
            raise ConfigError("; ".join(problems))
        if self.name != "siglip":
            problems.append(f"{prefix}.name={self.name!r}: only 'siglip' towers are implemented")
        if self.hidden_size % self.num_heads:
            problems.append(
                f"{prefix}.num_heads={self.num_heads} does not divide "
                f"{prefix}.hidden_size={self.hidden_size}"
            )
        if self.patch_size > self.image_size:
            problems.append(
                f"{prefix}.patch_size={self.patch_size} is larger than "
                f"{prefix}.image_size={self.image_size}"
            )
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"{prefix}.hidden_act={self.hidden_act!r}: use one of {ACTIVATIONS}")
        if problems:
            raise ConfigError("; ".join(problems))

    @classmethod
    def from_mapping(
        cls, raw: Mapping[str, Any], *, base: SiglipVisionConfig | None = None,
        prefix: str = "model.vision",
    ) -> SiglipVisionConfig:  # fmt: skip
        """The config of a run's ``model.vision`` section (``base`` fills keys not given);
        unknown keys raise a ``ConfigError`` naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ConfigError(
                f"{', '.join(f'{prefix}.{k}' for k in unknown)}: unknown key(s)",
                fix=f"SigLIP towers take {sorted(names)}",
            )
        if base is None:
            missing = sorted(
                f.name
                for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.name not in raw
            )
            if missing:
                raise ConfigError(
                    f"{', '.join(f'{prefix}.{k}' for k in missing)}: required",
                    fix="pick a tower with model/vision@model.vision=<option>",
                )
            cfg = cls(**dict(raw))
        else:
            cfg = dataclasses.replace(base, **dict(raw))
        cfg.validate(prefix=prefix)
        return cfg

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any]) -> SiglipVisionConfig:
        """Read an HF ``SiglipVisionConfig`` dict."""
        d = dict(vision_config)
        cfg = cls(
            hidden_size=int(d.get("hidden_size", 768)),
            intermediate_size=int(d.get("intermediate_size", 3072)),
            num_layers=int(d.get("num_hidden_layers", 12)),
            num_heads=int(d.get("num_attention_heads", 12)),
            image_size=int(d.get("image_size", 224)),
            patch_size=int(d.get("patch_size", 16)),
            in_channels=int(d.get("num_channels", 3)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-6)),
            hidden_act=str(d.get("hidden_act", "gelu_pytorch_tanh")),
        )
        cfg.validate(prefix="vision_config")
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` dict of an HF ``SiglipVisionConfig`` (no pooling head)."""
        return {
            "model_type": "siglip_vision_model",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "image_size": self.image_size,
            "patch_size": self.patch_size,
            "num_channels": self.in_channels,
            "layer_norm_eps": self.layer_norm_eps,
            "hidden_act": self.hidden_act,
            "vision_use_head": False,
        }


VISION_FLAVORS: dict[str, SiglipVisionConfig] = {
    # SigLIP so400m-patch14-384 as LLaVA-OneVision uses it: 26 of its 27 blocks.
    "so400m": SiglipVisionConfig(
        hidden_size=1152,
        intermediate_size=4304,
        num_layers=26,
        num_heads=16,
        image_size=384,
        patch_size=14,
    ),
    "tiny": SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        image_size=16,
        patch_size=4,
    ),
}
"""SigLIP towers: ``so400m`` (LLaVA-OneVision's) and a CPU-sized ``tiny``."""

"""FLUX.1 image MMDiT: architecture dataclass, diffusers ``config.json`` in and out, flavors.

Field names follow diffusers' ``FluxTransformer2DModel`` constructor, so a checkpoint's
``config.json`` maps onto ``FluxConfig`` key by key (``FluxConfig.from_diffusers``) and
``to_diffusers`` writes one that ``FluxTransformer2DModel.from_pretrained`` reads. Defaults are
diffusers' (FLUX.1 [schnell]'s shape: 19 double-stream and 38 single-stream blocks, 24 heads of
128, 64 token channels, T5 width 4096, CLIP pooled width 768, rotary axes 16 / 56 / 56).

A token is a 2x2 patch of the 16-channel VAE latent (the FLUX pipelines' packing), so the
model takes latents ``[B, in_channels / 4, T, H, W]`` like the Wan family (``patch_size``
``(1, 2, 2)``; images are one frame) and diffusers' ``in_channels`` (64) is the token width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError, ConfigProblem
from longboat.diffusion.models.common import config as common

DIFFUSERS_CLASS = "FluxTransformer2DModel"
"""``_class_name`` of the diffusers model this family reads and writes."""

LATENT_PATCH = (1, 2, 2)
"""Latent (frames, rows, columns) folded into one token by the FLUX pipelines' packing."""


@dataclass(frozen=True, kw_only=True)
class FluxConfig(common.DiTConfigBase):
    """Shape of a FLUX.1-style MMDiT (one ``FluxTransformer2DModel``)."""

    num_layers: int = 19
    """Double-stream blocks (separate image / text weights, joint attention)."""
    num_single_layers: int = 38
    """Single-stream blocks (one weight set on the text + image sequence)."""
    num_attention_heads: int = 24
    """Attention heads of every block."""
    attention_head_dim: int = 128
    """Channels per head; the width is ``num_attention_heads * attention_head_dim``."""
    in_channels: int = 64
    """Channels of one token: the latent channels of a 2x2 patch (FLUX: 16 x 4)."""
    out_channels: int | None = None
    """Channels of one output token (None: ``in_channels``)."""
    joint_attention_dim: int = 4096
    """Width of the text-encoder token embeddings (T5-XXL: 4096)."""
    pooled_projection_dim: int = 768
    """Width of the pooled text embedding (CLIP-L: 768)."""
    guidance_embeds: bool = False
    """Embed a guidance scale beside the timestep (guidance-distilled FLUX.1 [dev])."""
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    """Channels of each head rotated by the (frame, row, column) id; they sum to the head
    dim."""
    patch_size: int = 1
    """diffusers' ``patch_size`` (FLUX.1: 1; the 2x2 packing happens before the model)."""
    mlp_ratio: float = 4.0
    """Feed-forward width / model width (fixed by diffusers; not a config.json key)."""
    eps: float = 1e-6
    """Epsilon of every LayerNorm and qk RMSNorm (fixed by diffusers)."""
    rope_theta: float = 10000.0
    """Rotary base of each axis (fixed by diffusers)."""
    guidance_scale: float = 3.5
    """The guidance value a guidance-distilled model is given when a call passes none
    (training; diffusers' FLUX fine-tuning scripts default to 3.5). Not an architecture key."""
    recompute_blocks: int = 0
    """Activation recompute: the first ``n`` blocks (double-stream first, then single-stream)
    keep only their inputs and recompute their activations in the backward; ``-1``: every
    block. Not an architecture key."""
    recompute_attention: bool = False
    """Whether recomputed blocks also run the joint attention again (least memory); False
    keeps its outputs (``common.recompute``). Not an architecture key."""

    # -- derived ----------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        """Model width: ``num_attention_heads * attention_head_dim``."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def ffn_dim(self) -> int:
        """Feed-forward inner width: ``hidden_size * mlp_ratio``."""
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def token_out_channels(self) -> int:
        """Channels of one output token."""
        return self.out_channels or self.in_channels

    @property
    def latent_patch(self) -> tuple[int, int, int]:
        """Latent ``(frames, rows, columns)`` of one token."""
        return LATENT_PATCH

    @property
    def patch_volume(self) -> int:
        """Latent positions per token (4)."""
        t, h, w = LATENT_PATCH
        return t * h * w

    @property
    def latent_channels(self) -> int:
        """Channels of the latents the model takes (the VAE's: ``in_channels / 4``)."""
        return self.in_channels // self.patch_volume

    @property
    def latent_out_channels(self) -> int:
        """Channels of the predicted latents."""
        return self.token_out_channels // self.patch_volume

    @property
    def text_dim(self) -> int:
        """Width of the caption token embeddings (``joint_attention_dim``)."""
        return self.joint_attention_dim

    @property
    def num_blocks(self) -> int:
        """Double- plus single-stream blocks."""
        return self.num_layers + self.num_single_layers

    # -- validation -------------------------------------------------------------------------

    def validate(self, *, prefix: str = "model") -> None:
        """Raise ``ConfigError`` naming every inconsistent key and its fix."""
        problems: list[ConfigProblem] = []

        def bad(key: str, message: str, fix: str) -> None:
            problems.append(
                ConfigProblem(
                    key=f"{prefix}.{key}", message=message, value=getattr(self, key), fix=fix
                )
            )

        for key in (
            "num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
            "in_channels", "joint_attention_dim", "pooled_projection_dim",
        ):  # fmt: skip
            value = getattr(self, key)
            least = 0 if key in ("num_layers", "num_single_layers") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                bad(key, f"must be an integer >= {least}.", f"set {prefix}.{key}>={least}.")
        if problems:
            raise ConfigError(problems)
        if self.num_blocks < 1:
            bad("num_layers", "the model needs at least one block.", "set num_layers>=1.")
        out = self.out_channels
        if out is not None and (isinstance(out, bool) or not isinstance(out, int) or out < 1):
            bad("out_channels", "must be a positive integer or null.", "use null (in_channels).")
        for key, channels in (("in_channels", self.in_channels), ("out_channels", out)):
            if isinstance(channels, int) and channels % self.patch_volume:
                bad(
                    key,
                    f"a token is a 2x2 latent patch, so the channels must divide by "
                    f"{self.patch_volume}.",
                    "use 4 x the VAE's latent channels (FLUX.1: 64).",
                )
        if self.patch_size != 1:
            bad("patch_size", "only 1 is implemented (FLUX.1's).", "use patch_size=1.")
        axes = tuple(self.axes_dims_rope)
        if len(axes) != 3 or any(not isinstance(a, int) or a < 2 or a % 2 for a in axes):
            bad("axes_dims_rope", "must be three even integers >= 2.", "e.g. [16, 56, 56].")
        elif sum(axes) != self.attention_head_dim:
            bad(
                "axes_dims_rope",
                f"must sum to attention_head_dim={self.attention_head_dim} (sum {sum(axes)}).",
                "split the head dim over (frame, row, column), FLUX.1: [16, 56, 56] of 128.",
            )
        if not self.mlp_ratio > 0 or self.hidden_size * self.mlp_ratio % 1:
            bad("mlp_ratio", "must give an integer feed-forward width.", "FLUX.1 uses 4.0.")
        if not self.eps > 0:
            bad("eps", "must be positive.", "FLUX.1 uses 1e-6.")
        recompute = self.recompute_problem(prefix)
        if recompute is not None:
            problems.append(recompute)
        if problems:
            raise ConfigError(problems)

    def validate_parallel(
        self, *, tensor_parallel: int, context_parallel: int = 1, prefix: str = "model"
    ) -> None:
        """Raise ``ConfigError`` when ``tensor_parallel`` does not divide the heads and the
        feed-forward width, or ``context_parallel`` is not 1 (not implemented for FLUX)."""
        problems = common.tensor_parallel_problems(
            {"num_attention_heads": self.num_attention_heads, "ffn_dim": self.ffn_dim},
            tensor_parallel,
            prefix=prefix,
            fix="use a tensor_parallel that divides the head count and ffn width.",
        )
        if context_parallel != 1:
            problems.append(
                ConfigProblem(
                    key="parallel.context_parallel",
                    value=context_parallel,
                    message="context parallelism is not implemented for the flux family.",
                    fix="set parallel.context_parallel=1 (use tensor or data parallelism).",
                )
            )
        if problems:
            raise ConfigError(problems)

    # -- diffusers --------------------------------------------------------------------------

    def to_diffusers(self) -> dict[str, Any]:
        """The ``FluxTransformer2DModel`` constructor arguments (``config.json`` keys)."""
        return {
            "patch_size": self.patch_size,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "num_layers": self.num_layers,
            "num_single_layers": self.num_single_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            "joint_attention_dim": self.joint_attention_dim,
            "pooled_projection_dim": self.pooled_projection_dim,
            "guidance_embeds": self.guidance_embeds,
            "axes_dims_rope": list(self.axes_dims_rope),
        }

    @classmethod
    def from_diffusers(
        cls, config: Mapping[str, Any], *, source: str = "config.json"
    ) -> FluxConfig:
        """The architecture of a diffusers ``FluxTransformer2DModel`` ``config.json`` dict.

        Keys starting with ``_`` and unknown keys are ignored; missing keys take diffusers'
        defaults.
        """
        common.check_class_name(config, DIFFUSERS_CLASS, "a FLUX", source)
        keys = cls().to_diffusers()
        values = {k: config.get(k, v) for k, v in keys.items()}
        values["axes_dims_rope"] = tuple(int(a) for a in values["axes_dims_rope"])
        values["guidance_embeds"] = bool(values["guidance_embeds"])
        out = cls(**values)
        out.validate(prefix="model")
        return out


def read_config(path: str | Path) -> FluxConfig:
    """The ``FluxConfig`` of a diffusers transformer directory (or a pipeline directory holding
    ``transformer/``), from its ``config.json``."""
    return common.read_config_json(resolve_transformer_dir(path), FluxConfig.from_diffusers)


def resolve_transformer_dir(path: str | Path) -> Path:
    """``path`` itself when it has a ``config.json``, else its ``transformer/`` subfolder (a
    diffusers pipeline directory); ``ConfigError`` naming ``model.init_from`` otherwise."""
    return common.resolve_transformer_dir(path, class_name=DIFFUSERS_CLASS, pipeline="FLUX")


FLAVORS: dict[str, FluxConfig] = {
    # Trains on CPU in seconds: 2 double + 2 single blocks x 32 wide, FLUX's 16 latent
    # channels, the tiny synthetic captions' width 32; rotary split (4, 6, 6) of head dim 16.
    "tiny": FluxConfig(
        num_layers=2,
        num_single_layers=2,
        num_attention_heads=2,
        attention_head_dim=16,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ),
    # black-forest-labs/FLUX.1-dev transformer/config.json.
    "flux_dev": FluxConfig(guidance_embeds=True),
    # black-forest-labs/FLUX.1-schnell transformer/config.json.
    "flux_schnell": FluxConfig(guidance_embeds=False),
}


def flavor(name: str) -> FluxConfig:
    """Flavor ``name``; ``ConfigError`` naming ``model.flavor`` and the flavors otherwise."""
    return common.pick_flavor(FLAVORS, name, "flux")

"""Wan 2.1 / 2.2 text-to-video DiT: architecture dataclass, diffusers ``config.json`` in and
out, flavors.

Field names follow diffusers' ``WanTransformer3DModel`` constructor, so a checkpoint's
``config.json`` maps onto ``WanConfig`` key by key (``WanConfig.from_diffusers``), and
``to_diffusers`` writes one that ``WanTransformer3DModel.from_pretrained`` reads. Defaults are
diffusers' (``eps`` 1e-6, ``freq_dim`` 256, ``text_dim`` 4096, patch ``(1, 2, 2)``, 16 latent
channels, RMS qk-norm across heads, affine cross-attention norm, rotary tables up to 1024
positions per axis).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError, ConfigProblem
from longboat.diffusion.models.common import config as common

DIFFUSERS_CLASS = "WanTransformer3DModel"
"""``_class_name`` of the diffusers model this family reads and writes."""

QK_NORMS = ("rms_norm_across_heads",)
"""qk-norm kinds implemented (diffusers' only one: RMSNorm over all heads' channels)."""

# diffusers config keys of conditioning this family does not implement yet (image-to-video).
_UNSUPPORTED = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")


@dataclass(frozen=True, kw_only=True)
class WanConfig(common.DiTConfigBase):
    """Shape of a Wan text-to-video DiT (one ``WanTransformer3DModel``)."""

    num_layers: int
    """Transformer blocks."""
    num_attention_heads: int
    """Attention heads of the self- and cross-attention."""
    ffn_dim: int
    """Inner width of each block's GELU(tanh) feed-forward."""
    attention_head_dim: int = 128
    """Channels per head; the width is ``num_attention_heads * attention_head_dim``."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """Latent patch (frames, height, width) folded into one token."""
    in_channels: int = 16
    """Latent channels in (the VAE's ``z_dim``)."""
    out_channels: int = 16
    """Channels of the prediction."""
    text_dim: int = 4096
    """Width of the text-encoder embeddings (UMT5-XXL: 4096)."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep embedding."""
    cross_attn_norm: bool = True
    """Affine LayerNorm before the text cross-attention (identity when False)."""
    qk_norm: str = "rms_norm_across_heads"
    """RMSNorm of queries and keys over all heads' channels (before the rotary embedding)."""
    eps: float = 1e-6
    """Epsilon of every LayerNorm and RMSNorm."""
    rope_max_seq_len: int = 1024
    """Positions per axis diffusers builds rotary tables for (kept for the round trip; the
    tables here are computed for any grid)."""
    rope_theta: float = 10000.0
    """Rotary base of each axis (diffusers fixes it at 10000; not a config.json key)."""
    recompute_blocks: int = 0
    """Activation recompute: the first ``n`` blocks keep only their inputs and recompute
    their activations in the backward; ``-1``: every block. Not an architecture key."""
    recompute_attention: bool = False
    """Whether recomputed blocks also run self-attention again (least memory); False keeps
    its outputs (``common.recompute``). Not an architecture key."""

    # -- derived ----------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        """Model width: ``num_attention_heads * attention_head_dim``."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def latent_patch(self) -> tuple[int, int, int]:
        """Latent ``(frames, rows, columns)`` of one token (``patch_size``; the name every
        family shares, read by the training run's checks and batching)."""
        return tuple(self.patch_size)  # type: ignore[return-value]

    @property
    def latent_channels(self) -> int:
        """Channels of the latents the model takes (``in_channels``)."""
        return self.in_channels

    @property
    def latent_out_channels(self) -> int:
        """Channels of the predicted latents (``out_channels``)."""
        return self.out_channels

    @property
    def num_blocks(self) -> int:
        """Transformer blocks (``num_layers``)."""
        return self.num_layers

    @property
    def patch_volume(self) -> int:
        """Latent positions per token: ``prod(patch_size)``."""
        t, h, w = self.patch_size
        return t * h * w

    @property
    def patch_dim(self) -> int:
        """Length of one input token: ``in_channels * prod(patch_size)``."""
        return self.in_channels * self.patch_volume

    @property
    def out_patch_dim(self) -> int:
        """Length of one output token: ``out_channels * prod(patch_size)``."""
        return self.out_channels * self.patch_volume

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """Channels of each head rotated by (frame, row, column) position: height and width get
        ``2 * (head_dim // 6)`` each, time the rest (diffusers' / Wan's split)."""
        hw = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - 2 * hw, hw, hw

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
            "num_layers", "num_attention_heads", "ffn_dim", "attention_head_dim",
            "in_channels", "out_channels", "text_dim", "freq_dim", "rope_max_seq_len",
        ):  # fmt: skip
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(key, "must be a positive integer.", f"set {prefix}.{key}>=1.")
        if problems:
            raise ConfigError(problems)
        patch = tuple(self.patch_size)
        if len(patch) != 3 or any(not isinstance(p, int) or p < 1 for p in patch):
            bad("patch_size", "must be three positive integers (t, h, w).", "e.g. [1, 2, 2].")
        if self.attention_head_dim % 2 or min(self.rope_dims) < 2 or self.rope_dims[0] % 2:
            bad(
                "attention_head_dim",
                f"the rotary split (time, height, width) = {self.rope_dims} needs even parts "
                "of at least 2 channels.",
                "use an even attention_head_dim >= 6 (Wan: 128).",
            )
        if self.freq_dim % 2:
            bad("freq_dim", "must be even (cos and sin halves).", "use an even freq_dim.")
        if self.qk_norm not in QK_NORMS:
            bad("qk_norm", f"is not implemented (known: {list(QK_NORMS)}).", "use one of them.")
        if not self.eps > 0:
            bad("eps", "must be positive.", "Wan uses 1e-6.")
        recompute = self.recompute_problem(prefix)
        if recompute is not None:
            problems.append(recompute)
        if problems:
            raise ConfigError(problems)

    def validate_parallel(
        self, *, tensor_parallel: int, context_parallel: int = 1, prefix: str = "model"
    ) -> None:
        """Raise ``ConfigError`` when ``tensor_parallel`` does not divide heads and FFN width,
        or ``tensor_parallel * context_parallel`` the heads (Ulysses splits each TP rank's
        heads over the context-parallel ranks)."""
        problems = common.tensor_parallel_problems(
            {"num_attention_heads": self.num_attention_heads, "ffn_dim": self.ffn_dim},
            tensor_parallel,
            prefix=prefix,
            fix="use a tensor_parallel that divides the head count and ffn_dim.",
        )
        heads = self.num_attention_heads
        if not problems and heads % (tensor_parallel * context_parallel):
            problems.append(
                ConfigProblem(
                    key="parallel.context_parallel",
                    value=context_parallel,
                    message=f"tensor_parallel x context_parallel = {tensor_parallel} x "
                    f"{context_parallel} must divide {prefix}.num_attention_heads={heads} "
                    "(each context-parallel rank attends with a share of the heads).",
                    fix="use a context_parallel that divides "
                    f"{heads // tensor_parallel} (the heads per tensor-parallel rank).",
                )
            )
        if problems:
            raise ConfigError(problems)

    # -- diffusers --------------------------------------------------------------------------

    def to_diffusers(self) -> dict[str, Any]:
        """The ``WanTransformer3DModel`` constructor arguments (``config.json`` keys)."""
        return {
            "patch_size": list(self.patch_size),
            "num_attention_heads": self.num_attention_heads,
            "attention_head_dim": self.attention_head_dim,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "text_dim": self.text_dim,
            "freq_dim": self.freq_dim,
            "ffn_dim": self.ffn_dim,
            "num_layers": self.num_layers,
            "cross_attn_norm": self.cross_attn_norm,
            "qk_norm": self.qk_norm,
            "eps": self.eps,
            "image_dim": None,
            "added_kv_proj_dim": None,
            "rope_max_seq_len": self.rope_max_seq_len,
            "pos_embed_seq_len": None,
        }

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any], *, source: str = "config.json") -> WanConfig:
        """The architecture of a diffusers ``WanTransformer3DModel`` ``config.json`` dict.

        Keys starting with ``_`` and keys this family does not know are ignored; missing keys
        take diffusers' defaults. Image-to-video checkpoints (``image_dim`` /
        ``added_kv_proj_dim``) raise ``ConfigError``.
        """
        common.check_class_name(config, DIFFUSERS_CLASS, "a Wan", source)
        for key in _UNSUPPORTED:
            if config.get(key) is not None:
                raise ConfigError(
                    f"{source}: {key}={config[key]!r} is image-to-video conditioning, which the "
                    "wan family does not implement yet",
                    key="model.init_from",
                    fix="use a text-to-video checkpoint (Wan2.1-T2V, Wan2.2-T2V / TI2V).",
                )
        diffusers_defaults = {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 40,
            "attention_head_dim": 128,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 4096,
            "freq_dim": 256,
            "ffn_dim": 13824,
            "num_layers": 40,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "eps": 1e-6,
            "rope_max_seq_len": 1024,
        }
        values = {k: config.get(k, v) for k, v in diffusers_defaults.items()}
        values["patch_size"] = tuple(int(p) for p in values["patch_size"])
        values["out_channels"] = values["out_channels"] or values["in_channels"]
        out = cls(**values)
        out.validate(prefix="model")
        return out


def read_config(path: str | Path) -> WanConfig:
    """The ``WanConfig`` of a diffusers transformer directory (or a pipeline directory holding
    ``transformer/``), from its ``config.json``."""
    return common.read_config_json(resolve_transformer_dir(path), WanConfig.from_diffusers)


def resolve_transformer_dir(path: str | Path) -> Path:
    """``path`` itself when it has a ``config.json``, else its ``transformer/`` subfolder (a
    diffusers pipeline directory); ``ConfigError`` naming ``model.init_from`` otherwise."""
    return common.resolve_transformer_dir(path, class_name=DIFFUSERS_CLASS, pipeline="Wan")


FLAVORS: dict[str, WanConfig] = {
    # Trains on CPU in seconds; the rotary split of head_dim 16 is (8, 4, 4).
    "tiny": WanConfig(
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=16,
        ffn_dim=64,
        text_dim=32,
        freq_dim=32,
    ),
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json.
    "t2v_1_3b": WanConfig(num_layers=30, num_attention_heads=12, ffn_dim=8960),
    # Wan-AI/Wan2.1-T2V-14B-Diffusers; each of Wan2.2-T2V-A14B's two experts has this shape.
    "t2v_14b": WanConfig(num_layers=40, num_attention_heads=40, ffn_dim=13824),
}


def flavor(name: str) -> WanConfig:
    """Flavor ``name``; ``ConfigError`` naming ``model.flavor`` and the flavors otherwise."""
    return common.pick_flavor(FLAVORS, name, "wan")

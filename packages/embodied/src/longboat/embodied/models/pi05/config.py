"""pi0.5 configuration: full (~3.3B) and tiny (CPU tests) flavors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from longboat.embodied.models.common.image_preprocessing import ImagePreprocessConfig
from longboat.embodied.models.common.lm import DecoderConfig
from longboat.embodied.models.common.vit import ViTConfig, siglip_so400m


@dataclass(kw_only=True)
class Pi05Config:
    """pi0.5: SigLIP + Gemma VLM (prefix) and a Gemma action expert (suffix) sharing one
    attention per layer; flow matching with adaRMSNorm time conditioning."""

    vision: ViTConfig
    """Vision tower (SigLIP So400m/14 in the full flavor)."""
    llm: DecoderConfig
    """Gemma language model (prefix expert)."""
    expert: DecoderConfig
    """Gemma action expert (suffix); heads, KV heads, head_dim and layers match ``llm``."""
    image: ImagePreprocessConfig = field(
        default_factory=lambda: ImagePreprocessConfig(
            pad_to_square=224, crop_fraction=0.95, multiple_of=14
        )
    )
    """Camera-frame preprocessing."""
    num_cameras: int = 3
    """Cameras per sample (missing ones are masked with ``image_mask``)."""
    action_dim: int = 32
    """Padded action width (and state width)."""
    max_state_dim: int = 32
    """Padded state width; each state dim is one discrete token."""
    action_horizon: int = 50
    """Action chunk length."""
    num_state_bins: int = 256
    """State values in [-1, 1] are discretised into this many bins."""
    state_token_offset: int | None = None
    """Token id of bin 0 (None: the last ``num_state_bins`` ids of the vocab)."""
    max_token_len: int = 200
    """Maximum text + state tokens in the prompt (the text gets ``max_token_len -
    max_state_dim``: LeRobot's ``tokenizer_max_length``)."""
    state_in_prompt: bool = False
    """The state is spelled as text inside the tokenised prompt (LeRobot's / openpi's pi0.5
    format, ``processor.pi05_prompt``), so no state tokens follow the text; False: the state
    becomes ``max_state_dim`` discrete tokens after the text (runs with the byte-level
    stand-in tokenizer)."""
    time_min_period: float = 4e-3
    """Smallest period of the sin-cos time embedding."""
    time_max_period: float = 4.0
    """Largest period of the sin-cos time embedding."""
    num_inference_steps: int = 10
    """Euler steps in ``predict_action`` (t: 1 -> 0)."""
    noise_beta_alpha: float = 1.5
    """t = Beta(alpha, 1) * 0.999 + 0.001."""
    tune_visual: bool = True
    """Train the ViT and projector."""
    tune_llm: bool = True
    """Train the whole language model."""
    tune_top_llm_layers: int = 0
    """With tune_llm=False, train this many top LM layers."""
    tune_action_head: bool = True
    """Train the action expert, time MLP and action projections."""
    frozen_dtype: str = "bfloat16"
    """dtype of frozen parameters after ``apply_freezing`` (trainable ones are fp32)."""

    FLAVORS: ClassVar[dict[str, Callable[[], Pi05Config]]]

    def __post_init__(self) -> None:
        for key in ("num_heads", "num_kv_heads", "head_dim", "num_layers"):
            a, b = getattr(self.llm, key), getattr(self.expert, key)
            if a != b:
                raise ValueError(
                    f"expert.{key}={b} must equal llm.{key}={a}: the experts share one "
                    "attention per layer"
                )
        if self.vision.patch_size and self.image.multiple_of % self.vision.patch_size:
            raise ValueError(
                f"image.multiple_of={self.image.multiple_of} must be a multiple of "
                f"vision.patch_size={self.vision.patch_size}"
            )
        if self.bin_offset < 0 or self.bin_offset + self.num_state_bins > self.llm.vocab_size:
            raise ValueError(
                f"state tokens [{self.bin_offset}, {self.bin_offset + self.num_state_bins}) do "
                f"not fit the vocab of {self.llm.vocab_size}; fix state_token_offset"
            )
        if self.max_state_dim > self.max_token_len:
            raise ValueError(
                f"max_state_dim={self.max_state_dim} state tokens exceed "
                f"max_token_len={self.max_token_len}"
            )

    def input_image_size(self) -> tuple[int, int]:
        """(height, width) the model's square image size (``image.pad_to_square``: 224 full,
        56 tiny): cameras of different sizes are each resized to it before batching with
        openpi's ``resize_with_pad`` (aspect kept, black padding)."""
        side = self.image.pad_to_square or self.image.resize_shortest
        if side is None:
            side = self.vision.pos_grid[0] * self.vision.patch_size
        return side, side

    def prompt_length(self) -> int:
        """Text tokens per prompt: LeRobot's ``tokenizer_max_length``."""
        return self.max_token_len - self.max_state_dim

    @property
    def bin_offset(self) -> int:
        """Token id of state bin 0."""
        if self.state_token_offset is not None:
            return self.state_token_offset
        return self.llm.vocab_size - self.num_state_bins


def full() -> Pi05Config:
    """openpi's pi0.5 shapes (~3.3B parameters)."""
    return Pi05Config(
        vision=siglip_so400m(pos_grid=(16, 16)),
        llm=DecoderConfig(
            hidden_size=2048,
            num_layers=18,
            num_heads=8,
            num_kv_heads=1,
            head_dim=256,
            intermediate_size=16384,
            vocab_size=257152,
            style="gemma",
        ),
        expert=DecoderConfig(
            hidden_size=1024,
            num_layers=18,
            num_heads=8,
            num_kv_heads=1,
            head_dim=256,
            intermediate_size=4096,
            style="gemma",
        ),
    )


def tiny() -> Pi05Config:
    """Every component at toy size: 56x56 frames (16 tokens), 3 cameras (CPU tests)."""
    return Pi05Config(
        vision=ViTConfig(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            intermediate_size=128,
            patch_size=14,
            pos_grid=(4, 4),
        ),
        llm=DecoderConfig(
            hidden_size=64,
            num_layers=4,
            num_heads=8,
            num_kv_heads=1,
            head_dim=16,
            intermediate_size=128,
            vocab_size=1024,
            style="gemma",
        ),
        expert=DecoderConfig(
            hidden_size=32,
            num_layers=4,
            num_heads=8,
            num_kv_heads=1,
            head_dim=16,
            intermediate_size=64,
            style="gemma",
        ),
        image=ImagePreprocessConfig(pad_to_square=56, crop_fraction=0.95, multiple_of=14),
        action_dim=8,
        max_state_dim=8,
        action_horizon=10,
        max_token_len=48,
    )


Pi05Config.FLAVORS = {"full": full, "tiny": tiny}

"""GR00T N1.6 configuration: full (~2.9B) and tiny (CPU tests) flavors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from longboat.embodied.models.common.category_specific import CategoryImpl
from longboat.embodied.models.common.dit import DiTConfig
from longboat.embodied.models.common.image_preprocessing import ImagePreprocessConfig
from longboat.embodied.models.common.lm import DecoderConfig
from longboat.embodied.models.common.vit import ViTConfig, siglip_so400m


@dataclass(kw_only=True)
class GrootN16Config:
    """GR00T N1.6: Eagle-style VLM backbone (SigLIP2 ViT + Qwen3 truncated at
    ``select_layer``) and an alternating DiT flow-matching action head."""

    vision: ViTConfig
    """Vision tower."""
    llm: DecoderConfig
    """Qwen3 language model (``num_layers`` = the full model; only ``select_layer`` built)."""
    dit: DiTConfig
    """Action-head DiT."""
    image: ImagePreprocessConfig = field(
        default_factory=lambda: ImagePreprocessConfig(resample="isaac")
    )
    """Camera-frame preprocessing (the flavors: Isaac-GR00T N1.6's, pixel for pixel)."""
    select_layer: int = 16
    """Backbone features = hidden state after layer select_layer-1; later layers are
    never built."""
    image_token_id: int = 151669
    """Placeholder token id whose positions receive image embeddings."""
    pixel_unshuffle: int = 2
    """Pixel-unshuffle factor of the projector (2x2 patches -> one token)."""
    num_embodiments: int = 32
    """Number of per-embodiment weight sets in the category-specific layers."""
    max_state_dim: int = 128
    """Padded state width."""
    max_action_dim: int = 128
    """Padded action width."""
    action_horizon: int = 16
    """Action chunk length predicted by ``predict_action``."""
    state_hidden: int = 1024
    """Hidden width of the state encoder MLP."""
    action_decoder_hidden: int = 1024
    """Hidden width of the action decoder MLP."""
    max_seq_len: int = 1024
    """Rows of the learned action-token position embedding."""
    num_timestep_buckets: int = 1000
    """Flow time t in [0, 1] is bucketed to int(t * buckets) for the DiT."""
    num_inference_steps: int = 4
    """Euler steps in ``predict_action``."""
    noise_beta_alpha: float = 1.5
    """Alpha of the Beta(alpha, 1) time distribution."""
    noise_s: float = 0.999
    """t = noise_s * (1 - Beta)."""
    state_dropout_prob: float = 0.0
    """Training probability of replacing the state token by a learned mask token."""
    image_tokens_in_text: bool = False
    """False: ``input_ids`` hold text only and the image placeholders are prepended;
    True: every row already holds n_cams * tokens_per_image ``image_token_id`` tokens."""
    category_impl: CategoryImpl = "bmm"
    """Per-embodiment layer implementation: 'bmm' (gather + bmm) or 'grouped'."""
    tune_visual: bool = False
    """Train the ViT and projector."""
    tune_llm: bool = False
    """Train the whole (truncated) LM."""
    tune_top_llm_layers: int = 4
    """With tune_llm=False, train this many top kept LM layers."""
    tune_action_head: bool = True
    """Train vlln, encoders, DiT and decoder."""
    frozen_dtype: str = "bfloat16"
    """dtype of frozen parameters after ``apply_freezing`` (trainable ones are fp32)."""

    FLAVORS: ClassVar[dict[str, Callable[[], GrootN16Config]]]

    def __post_init__(self) -> None:
        if not 1 <= self.select_layer <= self.llm.num_layers:
            raise ValueError(
                f"select_layer={self.select_layer} must be in [1, llm.num_layers="
                f"{self.llm.num_layers}]"
            )
        if not 0 <= self.tune_top_llm_layers <= self.select_layer:
            raise ValueError(
                f"tune_top_llm_layers={self.tune_top_llm_layers} exceeds the "
                f"select_layer={self.select_layer} layers that are built"
            )
        if self.dit.cross_attention_dim != self.llm.hidden_size:
            raise ValueError(
                f"dit.cross_attention_dim={self.dit.cross_attention_dim} must equal "
                f"llm.hidden_size={self.llm.hidden_size} (the DiT reads LM features)"
            )
        if self.image.multiple_of % (self.vision.patch_size * self.pixel_unshuffle):
            raise ValueError(
                f"image.multiple_of={self.image.multiple_of} must be a multiple of "
                f"patch_size*pixel_unshuffle={self.vision.patch_size * self.pixel_unshuffle}"
            )
        if not 0 <= self.image_token_id < self.llm.vocab_size:
            raise ValueError(
                f"image_token_id={self.image_token_id} is outside the vocab of "
                f"{self.llm.vocab_size}"
            )

    def input_image_size(self) -> tuple[int, int]:
        """(height, width) the model's image size: cameras of different sizes are each resized
        to it before batching (an antialiased bilinear resize: a batch holds one frame size,
        where Isaac-GR00T's processor keeps each view's own aspect). The aspect of the ViT's position grid with the shorter side
        ``image.resize_shortest`` (full: 256x256, cropped to 252; tiny: 56x84)."""
        gh, gw = self.vision.pos_grid
        short = self.image.resize_shortest
        if short is None:
            return gh * self.vision.patch_size, gw * self.vision.patch_size
        return round(short * gh / min(gh, gw)), round(short * gw / min(gh, gw))

    def tokens_per_image(self, height: int, width: int) -> int:
        """LM tokens one camera frame of (height, width) becomes after preprocessing."""
        oh, ow = self.image.output_size(height, width)
        g = self.vision.patch_size * self.pixel_unshuffle
        return (oh // g) * (ow // g)


def full() -> GrootN16Config:
    """The released GR00T N1.6 shapes (~2.9B parameters)."""
    return GrootN16Config(
        # nvidia/Eagle-Block2A-2B-v2's SigLIP2 stores num_patches=256 positions, interpolated
        # to each image's patch grid (18x18 for the 252 px crops).
        vision=siglip_so400m(pos_grid=(16, 16)),
        llm=DecoderConfig(
            hidden_size=2048,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=6144,
            vocab_size=151680,
            rope_theta=1e6,
            qk_norm=True,
            style="qwen3",
        ),
        dit=DiTConfig(
            num_layers=32,
            num_heads=32,
            head_dim=48,
            cross_attention_dim=2048,
            output_dim=1024,
            dropout=0.2,
        ),
        image=ImagePreprocessConfig(
            resize_shortest=256, crop_fraction=0.95, multiple_of=28, resample="isaac"
        ),
    )


def tiny() -> GrootN16Config:
    """Every component at toy size: 84x56 frames, 2 cameras, 4 embodiments (CPU tests)."""
    return GrootN16Config(
        vision=ViTConfig(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            intermediate_size=128,
            patch_size=14,
            pos_grid=(4, 6),
        ),
        llm=DecoderConfig(
            hidden_size=64,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=512,
            rope_theta=1e6,
            qk_norm=True,
            style="qwen3",
        ),
        dit=DiTConfig(
            num_layers=4,
            num_heads=4,
            head_dim=16,
            cross_attention_dim=64,
            output_dim=32,
            dropout=0.0,
        ),
        image=ImagePreprocessConfig(
            resize_shortest=56, crop_fraction=0.95, multiple_of=28, resample="isaac"
        ),
        select_layer=3,
        image_token_id=511,
        num_embodiments=4,
        max_state_dim=8,
        max_action_dim=8,
        action_horizon=10,
        state_hidden=32,
        action_decoder_hidden=32,
        max_seq_len=32,
        tune_top_llm_layers=1,
    )


GrootN16Config.FLAVORS = {"full": full, "tiny": tiny}

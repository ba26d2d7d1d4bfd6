"""SmolVLA configuration: the SmolVLM2-500M-based flavor (~450M parameters) and a tiny one
(CPU tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from longboat.embodied.models.common.lm import DecoderConfig
from longboat.embodied.models.common.vit import ViTConfig

SMOLVLM2_500M = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
"""LeRobot's default backbone (the full flavor's shapes)."""


def expert_intermediate_size(width: int) -> int:
    """The action expert's MLP width for a residual ``width``: 4 * (2/3 of it), rounded up to
    a multiple of 256 (LeRobot's rule)."""
    inner = 4 * int(2 * width / 3)
    return 256 * ((inner + 255) // 256)


def expert_for(text: DecoderConfig, width_multiplier: float) -> DecoderConfig:
    """The action expert of a text model: its heads, head width and depth, a residual
    ``width_multiplier`` times as wide, no embedding table."""
    width = int(text.hidden_size * width_multiplier)
    return DecoderConfig(
        hidden_size=width,
        num_layers=text.num_layers,
        num_heads=text.num_heads,
        num_kv_heads=text.num_kv_heads,
        head_dim=text.head_dim,
        intermediate_size=expert_intermediate_size(width),
        rms_eps=text.rms_eps,
        rope_theta=text.rope_theta,
        style="qwen3",
    )


@dataclass(kw_only=True)
class SmolVLAConfig:
    """SmolVLA: a SmolVLM2 backbone (SigLIP-style vision tower, pixel-shuffle connector, the
    first ``text.num_layers`` SmolLM2 layers) whose per-layer keys and values feed an action
    expert, one expert layer per text layer: every ``self_attn_every_n_layers``-th layer the
    expert attends to the prefix and to itself (causally), the other layers it cross-attends
    to the prefix's keys and values projected to its own width. Flow matching on the
    expert's output (pi0's convention: t=1 noise, t=0 actions)."""

    vision: ViTConfig
    """Vision tower; its position table is the patch grid of ``image_size``."""
    scale_factor: int
    """Pixel-shuffle factor of the connector: scale_factor**2 patches become one token."""
    text: DecoderConfig
    """The SmolLM2 text model, truncated to the layers kept (``num_vlm_layers``)."""
    expert: DecoderConfig
    """The action expert (``expert_for``); heads, KV heads, head_dim and depth as ``text``."""
    attention_mode: Literal["cross_attn", "self_attn"] = "cross_attn"
    """cross_attn: layers not on the self-attention period cross-attend; self_attn: every
    layer attends to prefix and suffix jointly."""
    self_attn_every_n_layers: int = 2
    """Layers ``i % n == 0`` are self-attention layers (<= 0: none are, with cross_attn)."""
    num_cameras: int = 3
    """Camera slots per sample (missing ones are masked with ``image_mask``)."""
    action_dim: int = 32
    """Padded action width (LeRobot's ``max_action_dim``)."""
    max_state_dim: int = 32
    """Padded state width; the state is one projected prefix token."""
    action_horizon: int = 50
    """Action chunk length (LeRobot's ``chunk_size``)."""
    max_token_len: int = 48
    """Prompt tokens kept (LeRobot's ``tokenizer_max_length``)."""
    time_min_period: float = 4e-3
    """Smallest period of the sin-cos time embedding."""
    time_max_period: float = 4.0
    """Largest period of the sin-cos time embedding."""
    num_inference_steps: int = 10
    """Euler steps in ``predict_action`` (t: 1 -> 0)."""
    noise_beta_alpha: float = 1.5
    """t = Beta(alpha, 1) * 0.999 + 0.001."""
    tune_visual: bool = False
    """Train the vision tower and the connector (LeRobot: ``not freeze_vision_encoder`` and
    ``not train_expert_only``)."""
    tune_llm: bool = False
    """Train the text model (LeRobot: ``not train_expert_only``)."""
    tune_top_llm_layers: int = 0
    """With tune_llm=False, train this many top text layers."""
    tune_action_head: bool = True
    """Train the expert, its norm and the action / time projections."""
    tune_state_proj: bool = True
    """Train the state projection (LeRobot's ``train_state_proj``)."""
    frozen_dtype: str = "bfloat16"
    """dtype of frozen parameters after ``apply_freezing`` (trainable ones are fp32)."""
    vlm_model_name: str | None = None
    """The SmolVLM2 model whose config.json describes the backbone (LeRobot's
    ``vlm_model_name``: a Hub name or a local directory); None: none does, and the policy is
    not written in LeRobot's format, which builds the backbone from that config."""
    backbone_prompts: bool = False
    """The prompts are tokenised by the backbone's Hugging Face tokenizer (LeRobot's
    preprocessor: the task and a newline); set by a run with ``model.tokenizer`` or a LeRobot
    checkpoint. False: the byte-level stand-in's ids, which LeRobot's preprocessor does not
    produce, so such a run is not written in LeRobot's format."""

    FLAVORS: ClassVar[dict[str, Callable[[], SmolVLAConfig]]]

    def __post_init__(self) -> None:
        for key in ("num_heads", "num_kv_heads", "head_dim", "num_layers"):
            a, b = getattr(self.text, key), getattr(self.expert, key)
            if a != b:
                raise ValueError(
                    f"expert.{key}={b} must equal text.{key}={a}: the expert reads the text "
                    "model's keys and values layer by layer"
                )
        grid = self.vision.pos_grid
        if grid[0] != grid[1] or grid[0] % self.scale_factor:
            raise ValueError(
                f"vision.pos_grid={grid} must be a square whose side is a multiple of "
                f"scale_factor={self.scale_factor} (the connector's pixel shuffle)"
            )
        if self.text.vocab_size <= 0:
            raise ValueError("text.vocab_size must be > 0 (the prompt's token embeddings)")

    def input_image_size(self) -> tuple[int, int]:
        """(height, width) frames are resized to (aspect kept, padded on the left and top):
        the vision tower's image size."""
        side = self.vision.pos_grid[0] * self.vision.patch_size
        return side, side

    def image_tokens(self) -> int:
        """Prefix tokens per camera."""
        return (self.vision.pos_grid[0] // self.scale_factor) ** 2

    def is_cross_layer(self, index: int) -> bool:
        """Whether layer ``index`` cross-attends (else prefix and suffix attend jointly)."""
        if self.attention_mode != "cross_attn":
            return False
        n = self.self_attn_every_n_layers
        return not (n > 0 and index % n == 0)

    def prompt_length(self) -> int:
        """Prompt tokens per sample."""
        return self.max_token_len


def full() -> SmolVLAConfig:
    """LeRobot's smolvla_base shapes: SmolVLM2-500M-Video-Instruct's vision tower (512 px,
    16 px patches) and connector (pixel shuffle 4), its first 16 of 32 SmolLM2 layers, an
    expert 0.75 times as wide (~450M parameters)."""
    text = DecoderConfig(
        hidden_size=960,
        num_layers=16,
        num_heads=15,
        num_kv_heads=5,
        head_dim=64,
        intermediate_size=2560,
        vocab_size=49280,
        rms_eps=1e-5,
        style="qwen3",
    )
    return SmolVLAConfig(
        vision=ViTConfig(
            hidden_size=768,
            num_layers=12,
            num_heads=12,
            intermediate_size=3072,
            patch_size=16,
            pos_grid=(32, 32),
        ),
        scale_factor=4,
        text=text,
        expert=expert_for(text, 0.75),
        vlm_model_name=SMOLVLM2_500M,
    )


def tiny() -> SmolVLAConfig:
    """Every component at toy size: 32x32 frames (16 patches, 4 tokens), 3 cameras, every
    part trained (CPU tests)."""
    text = DecoderConfig(
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=1024,
        rms_eps=1e-5,
        style="qwen3",
    )
    return SmolVLAConfig(
        vision=ViTConfig(
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            intermediate_size=64,
            patch_size=8,
            pos_grid=(4, 4),
        ),
        scale_factor=2,
        text=text,
        expert=expert_for(text, 0.75),
        action_dim=8,
        max_state_dim=8,
        action_horizon=10,
        max_token_len=32,
        tune_visual=True,
        tune_llm=True,
        frozen_dtype="float32",
    )


SmolVLAConfig.FLAVORS = {"full": full, "tiny": tiny}

"""Typed config of VLM training runs: the model, the data kinds and the run settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from longboat.core.config.schema import (
    DataConfig,
    ExperimentConfig,
    LoRAConfig,
    ModelConfig,
    TrainConfig,
)


@dataclass
class VLMModelConfig(ModelConfig):
    """A vision-language model: a family and flavor, or a Hugging Face directory."""

    name: str = "qwen2_5_vl"
    flavor: str = "tiny"
    """``tiny`` (CPU tests) or a released size (``3b``, ``7b`` of qwen2_5_vl; ``2b``, ``4b``,
    ``8b`` of qwen3_vl); ignored with ``init_from`` (the checkpoint's config.json gives
    the architecture)."""
    init_from: str | None = None
    """A Hugging Face vision-language model directory to start from; its ``config.json``'s
    ``model_type`` picks the family and gives the architecture."""
    freeze: list[str] = field(default_factory=list)
    """Components that do not train: any of ``vision`` (the ViT blocks), ``projector`` (the
    patch merger; Qwen3-VL's deepstack mergers too), ``language`` (the decoder)."""
    lr_scale: dict[str, float] = field(default_factory=dict)
    """Learning-rate factors per component (``vision``, ``projector``, ``language``; the
    others train at ``optim.lr``), e.g. ``{vision: 0.1, projector: 0.1}``: the vision tower and
    projector at a tenth of the decoder's peak LR, the schedule's shape the same for all."""
    vision_tensor_parallel: int | None = None
    """Tensor-parallel size of the vision tower: null (the decoder's
    ``parallel.tensor_parallel``) or 1 under a TP decoder (Qwen-VL families, no pipeline
    parallelism): the tower unsharded, each TP rank encoding its share of the images and
    the embeddings exchanged, so the ViT costs no TP communication."""
    layer_backend: str = "auto"
    """Decoder layers: auto (Transformer Engine on CUDA when installed, else longboat
    kernels), longboat, te, local."""
    vision: dict[str, Any] = field(default_factory=dict)
    """Composed families (``llava_onevision``): the vision tower laid over the flavor's, e.g.
    ``model/vision=siglip_so400m`` (``flavor`` + field overrides); empty: the
    flavor's. Other families take none."""
    projector: dict[str, Any] = field(default_factory=dict)
    """Composed families: the projector (``name: mlp2x_gelu``; widths default to the tower's
    and the decoder's), e.g. ``model/projector=mlp2x_gelu``."""
    language: dict[str, Any] = field(default_factory=dict)
    """Composed families: the decoder, any core family (``name`` + ``flavor`` + field
    overrides), e.g. ``model/llm@model.language=qwen3_1_7b``."""


@dataclass
class ConversationsDataConfig(DataConfig):
    """LLaVA / ShareGPT conversations (JSON, JSONL or Parquet) with images and videos."""

    name: str = "conversations"
    paths: list[str] = field(default_factory=list)
    """Conversation files or folders of them."""
    root: str | None = None
    """Where relative image / video paths start (default: each file's folder)."""
    tokenizer: str | None = None
    """Tokenizer directory with a chat template (default: ``model.init_from``)."""
    seq_len: int = 2048
    """Tokens per packed row."""
    eval_fraction: float = 0.02
    """Fraction of samples held out for evaluation."""
    num_workers: int | None = None
    """Loader processes that build the next steps' rows (images decoded, resized and
    normalised) while the current one trains; null: 4 on an accelerator, 0 on CPU."""
    skip_bad_samples: bool = False
    """Skip (and count) samples whose image or video is missing or unreadable instead of
    stopping with an error naming it."""
    min_pixels: int | None = None
    """Smallest image area after resizing (pixels; null: the ``preprocessor_config.json`` of
    ``model.init_from``, else 3136)."""
    max_pixels: int | None = None
    """Largest image area after resizing (pixels; null: the ``preprocessor_config.json`` of
    ``model.init_from``, else 1003520)."""
    seed: int = 1234
    """Order of the rows."""
    cache_dir: str | None = None
    """Where the encoded samples are cached (``longboat-vlm data prepare`` or the first run
    writes, later runs with the same files, tokenizer and options reuse; null: encode every
    run)."""


@dataclass
class ShapesDataConfig(ConversationsDataConfig):
    """The quickstart's generated set: coloured shapes with questions about them."""

    name: str = "shapes"
    out_dir: str = "outputs/quickstart_vlm/data"
    """Where images, conversations and the tokenizer are written (reused when present)."""
    num_train: int = 600
    num_eval: int = 60
    image_size: int = 56
    """Side of the square images (pixels)."""
    questions_per_image: int | None = None
    """Question/answer turns per image, distinct kinds in a random order (null: one or two;
    4: colour, shape, position and a description, each image's tokens then carry four
    answers)."""
    seq_len: int = 512
    min_pixels: int | None = 3136
    max_pixels: int | None = 3136


@dataclass
class VLMRunConfig:
    """VLM-specific run settings."""

    cpu_precision: str = "fp32"
    """Precision used instead of train.precision on CPU."""
    eval_batches: int = 2
    """Microbatches of the held-out split per evaluation."""
    answer_eval_samples: int = 0
    """After export, answer this many held-out questions with ``transformers`` from the
    export and report how many it gets right (0: skip)."""
    num_threads: int = 0
    """torch intra-op threads on CPU (0: leave torch's default)."""
    dp_balance: bool = True
    """With data parallelism, deal each step's packed rows to the ranks by their cost
    (decoder attention quadratic in each sample's length, plus the ViT's per image) instead
    of rank r taking rows r, r + DP, ...; the global batch and the loss are the same."""


@dataclass
class VLMTrainConfig(TrainConfig):
    """The VLM training loop (core's fields; ``recompute`` left to the memory plan)."""

    recompute: str | None = None  # type: ignore[assignment]
    """Activation recompute: none, or full (each ViT block and each decoder layer keeps only
    its input; ``recompute_components`` picks vision and / or language). null (the default):
    the memory plan chooses (``train.memory_budget``): none where the tower and the decoder
    fit, else full; none where there is no budget (auto on a device without memory of its
    own, e.g. the CPU). A value set here is kept (pinned); a pinned run that cannot fit its
    budget is refused before work."""


@dataclass
class VLMExperimentConfig(ExperimentConfig):
    """Root config of ``longboat-vlm train``."""

    stack: str = "vlm"
    train: VLMTrainConfig = field(default_factory=VLMTrainConfig)
    """The training loop."""
    model: VLMModelConfig = field(default_factory=VLMModelConfig)
    vlm: VLMRunConfig = field(default_factory=VLMRunConfig)
    """VLM run settings (eval, data loading)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters on the language model (its base weights frozen; the vision tower
    and projector follow ``model.freeze``); the HF export has them merged."""

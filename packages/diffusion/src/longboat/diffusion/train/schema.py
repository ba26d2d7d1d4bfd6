"""Typed config of diffusion training runs: the model, the objective and the run settings
(the data configs live in :mod:`longboat.diffusion.data.schema`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from longboat.core.config.schema import ExperimentConfig, LoRAConfig, ModelConfig, TrainConfig
from longboat.diffusion.objective.flow_matching import FlowMatchingConfig

__all__ = [
    "DiffusionExperimentConfig",
    "DiffusionLoRAConfig",
    "DiffusionModelConfig",
    "DiffusionRunConfig",
    "DiffusionTrainConfig",
]


@dataclass
class DiffusionLoRAConfig(LoRAConfig):
    """Low-rank adapters on the transformer's attention and FFN linears (core's fields; the
    adapters also go out as a diffusers LoRA, ``export.adapter_dir``)."""

    targets: list[str] = field(
        default_factory=lambda: [
            "linear_q",
            "linear_k",
            "linear_v",
            "linear_proj",
            "linear_fc1",
            "linear_fc2",
        ]
    )
    """Names of the linears that get adapters (Wan: q / k / v / output of self- and
    cross-attention, the FFN's fc1 / fc2)."""


@dataclass
class DiffusionModelConfig(ModelConfig):
    """A diffusion transformer: a family and flavor, or a diffusers directory."""

    name: str = "wan"
    """Model family (``longboat.diffusion.models.registry``)."""
    flavor: str = "tiny"
    """``tiny`` (CPU tests) or a released shape (wan: ``t2v_1_3b``, ``t2v_14b``); ignored with
    ``init_from`` (the checkpoint's config.json gives the architecture)."""
    init_from: str | None = None
    """A diffusers transformer directory (or a pipeline directory with ``transformer/``) to
    start from: its ``config.json`` gives the family and the architecture, its safetensors
    the weights."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Architecture fields laid over the flavor, e.g. ``{num_layers: 4, ffn_dim: 128}`` (the
    family config's field names); not allowed with ``init_from``."""


@dataclass
class DiffusionRunConfig:
    """Diffusion-specific run settings: held-out loss, preview."""

    cpu_precision: str = "fp32"
    """Precision used instead of ``train.precision`` on CPU."""
    num_threads: int = 0
    """torch intra-op threads on CPU (0: leave torch's default)."""
    eval_sigmas: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    """Noise levels of the held-out loss: every held-out sample is noised at each level with
    noise fixed per sample, so evaluations are comparable across steps and runs (unweighted
    mean squared error of the velocity)."""
    eval_batch_size: int = 8
    """Held-out samples per forward."""
    eval_samples: int = 0
    """Held-out samples used (the first ones; 0: all)."""
    preview: bool = True
    """At the end (and every ``preview_every`` steps), sample latents for held-out captions
    (the training set's without a held-out set) in ``sample_steps`` Euler steps and write them
    beside the dataset's clips, each caption under its pair (``<output_dir>/preview``):
    decoded by the VAE of the run's pipeline (``pipeline_from`` / a pipeline
    ``model.init_from``), else by the preview set's own (its ``vae/``, as the quickstart's
    squares carry, or the VAE its manifest names), as an animated GIF (video) or a PNG grid
    (images); without a VAE (or diffusers) the latents through a fixed colour map."""
    preview_every: int = 0
    """Also write a preview every this many steps (0: only at the end)."""
    preview_format: str = "gif"
    """Video previews as an animated ``gif`` or an H.264 ``mp4`` (needs PyAV, the
    ``prepare`` extra); image previews are PNG grids either way."""
    preview_captions: int = 8
    """Held-out captions sampled for the preview (distinct captions, longest clips first)."""
    sample_steps: int = 10
    """Euler steps of the preview's sampler."""
    sample_shift: float | None = None
    """Timestep shift of the sampler (null: ``objective.shift``)."""
    pipeline_from: str | None = None
    """A diffusers pipeline directory (``model_index.json``) whose VAE, text encoder(s),
    tokenizer(s) and scheduler the export takes beside the trained transformer, so the export
    is a pipeline ``DiffusionPipeline.from_pretrained`` loads (null: ``model.init_from`` when
    it is a pipeline, else the export is the transformer alone)."""


@dataclass
class DiffusionTrainConfig(TrainConfig):
    """The diffusion training loop (core's fields; ``recompute`` left to the memory plan)."""

    recompute: str | None = None  # type: ignore[assignment]
    """Activation recompute of the DiT blocks: none; selective (a recomputed block keeps its
    input and its self-attention's outputs and runs the rest again in the backward); full
    (it keeps only its input); with ``recompute_layers`` only the first n blocks. null (the
    default): the memory plan chooses (``train.memory_budget``): none where everything fits,
    else selective, else full, then a smaller micro-batch (same-shape batches); none where
    there is no budget (auto on a device without memory of its own, e.g. the CPU). A value
    set here is kept (pinned); a pinned run that cannot fit its budget is refused before
    work."""


@dataclass
class DiffusionExperimentConfig(ExperimentConfig):
    """Root config of ``longboat-diffusion train``."""

    stack: str = "diffusion"
    train: DiffusionTrainConfig = field(default_factory=DiffusionTrainConfig)
    """The training loop."""
    model: DiffusionModelConfig = field(default_factory=DiffusionModelConfig)
    objective: FlowMatchingConfig = field(default_factory=FlowMatchingConfig)
    """How noise levels are drawn and weighted (flow matching as Wan trains it)."""
    diffusion: DiffusionRunConfig = field(default_factory=DiffusionRunConfig)
    """Diffusion run settings (held-out loss, preview)."""
    lora: DiffusionLoRAConfig = field(default_factory=DiffusionLoRAConfig)
    """Low-rank adapters (``lora.enabled``: only the adapters train)."""

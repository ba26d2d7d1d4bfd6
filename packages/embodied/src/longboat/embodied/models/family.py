"""The policy contract: one ``PolicyFamily`` object per policy folder.

A ``PolicyFamily`` is core's ``longboat.core.family.Family`` of the embodied stack, found by
core's registry: a policy folder (``longboat/embodied/models/<name>/``, a folder on
``LONGBOAT_FAMILY_PATH`` or a package named by the ``longboat.families`` entry point group)
exposes a module-level ``FAMILY = PolicyFamily(...)``. Everything the training run, the
exporters and ``model.init_from`` need to know about a policy is a field here, so nothing
outside the folder switches on the policy's name:

- ``schema`` (the config dataclass, with a ``FLAVORS`` mapping of factories that
  ``flavors_of`` turns into ``flavors``) and ``build`` (usually the model class, called as
  ``build(config)``: ``forward(batch) -> {"loss", ...}``, ``predict_action``,
  ``freezing_groups()``, ``parallel_blocks()``);
- ``batch_spec``: the shapes of the batches the policy takes (``PolicyBatchSpec``), which
  the collator turns LeRobot samples into;
- ``prompts``: the reference-format processor (a Hugging Face tokenizer's prompt);
- ``checkpoints``: the ``model.init_from`` adapter for its released checkpoints;
- ``backbones``: the Hugging Face backbones a from-scratch run may start from;
- ``export_formats``: the reference formats the end of a run writes (``export.format``);
- ``flops_per_sample``: the useful training FLOPs of one sample (benchmarks' MFU);
- ``lora_targets``: the linears ``lora.targets=[]`` adapts (PEFT's ``target_modules`` names).

Only those and ``batch_spec`` are required; a policy without the others trains from scratch
with the byte-level stand-in tokenizer and exports the native format only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from longboat.core.family import Family, LazyFlavors


@dataclass(frozen=True)
class PolicyBatchSpec:
    """Shapes a policy expects, read from its config."""

    max_state_dim: int
    """State is zero-padded to this many dims."""
    action_dim: int
    """Actions are zero-padded to this many dims."""
    horizon: int
    """Action-chunk length (``delta_timestamps`` of the action key)."""
    max_text_tokens: int
    """Prompt tokens kept per sample (the rest is cut)."""
    vocab_limit: int
    """Text ids are drawn below this (keeps special ids such as the image token free)."""
    num_cameras: int | None
    """Cameras the model expects (missing ones are zero images masked out); None: as read."""
    with_embodiment: bool
    """Emit ``embodiment_id`` (category-specific layers)."""
    with_image_mask: bool
    """Emit ``image_mask`` (which camera slots hold a frame)."""
    image_size: tuple[int, int] = (0, 0)
    """The model's image size (``input_image_size()`` of its config)."""
    pad_to_size: bool = False
    """Resize to ``image_size`` keeping the aspect ratio with black padding (openpi's
    ``resize_with_pad``); False: a plain bilinear resize."""
    resize_cameras: bool = False
    """Resize every frame not at ``image_size`` (the cameras differ in size). False: frames
    go to the model as read (its own preprocessing resizes them), unless a batch's frames
    differ in size after all."""


BatchSpecFn = Callable[..., PolicyBatchSpec]
"""``batch_spec(cfg, num_cameras, image_hw, *, resize_cameras) -> PolicyBatchSpec``:
``image_hw`` is the frame size batches carry (the model's ``input_image_size()`` with
``resize_cameras``)."""


@dataclass(frozen=True, kw_only=True)
class PromptProcessor:
    """How a policy reads prompts tokenised by a Hugging Face tokenizer (``model.tokenizer``):
    its reference processor."""

    find_tokenizer: Callable[[str | None, str | None], Path | None]
    """``(model.tokenizer, model.init_from) -> directory or None``; a bad directory is a
    ConfigError naming ``model.tokenizer``."""
    needs_tokenizer: Callable[[str | None], bool]
    """Whether the language model of ``model.init_from`` learnt a real tokenizer's ids."""
    missing_tokenizer_error: Callable[[str], Exception]
    """The error of a run that needs a tokenizer and has none."""
    build: Callable[[Path, Any], Any]
    """``(tokenizer dir, family config) -> prompt tokenizer`` for ``PolicyCollator``
    (checked against the model before it is built)."""
    config_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Family config fields set (unless ``model.overrides`` sets them) when prompts come from
    a real tokenizer: the reference's inputs."""
    hint: str = "set model.tokenizer=<dir> for the reference's prompt"
    """What a run without a tokenizer is told to set."""
    copy: Callable[[str | Path, str | Path], Path] | None = None
    """``(tokenizer dir, target dir) -> target``: how an export ships the tokenizer; None:
    every file of the directory is copied."""
    stand_in: Callable[[Path, Any], Path | None] | None = None
    """``(directory, family config) -> directory or None``: write a tokenizer for a
    from-scratch run that has none, so the run trains on the reference's prompt and its
    export ships the tokenizer (None returned: none can be made; the byte-level stand-in is
    used). None: such runs use the byte-level stand-in."""


StatisticsFn = Callable[[str, list[str], int, dict[str, int]], Mapping[str, Any] | None]


@dataclass(frozen=True, kw_only=True)
class CheckpointAdapter:
    """``model.init_from`` of a released checkpoint of the policy (its ecosystem format)."""

    description: str
    """What it reads, for messages (e.g. "LeRobot pi0.5 policies")."""
    resolve_config: Callable[[Mapping[str, Any], str], Any]
    """``(model.overrides, directory) -> family config``: the checkpoint's architecture plus
    the overrides, its weights' names and shapes checked (a CheckpointError otherwise)."""
    load_weights: Callable[[nn.Module, str], None]
    """Copy the checkpoint's weights into a model built from that config."""
    statistics: StatisticsFn | None = None
    """``(directory, sub-dataset names, index, {feature: width}) -> normaliser statistics or
    None``: the checkpoint's own statistics of sub-dataset ``index`` (None: the dataset's
    ``meta/stats.json`` is used)."""


@dataclass(frozen=True, kw_only=True)
class BackboneAdapter:
    """``model.init_from`` of a Hugging Face backbone alone (``hf_backbones``)."""

    kinds: Mapping[str, Any]
    """``model_type`` -> ``hf_backbones.BackboneKind`` the policy initialises from."""
    backbone_state: Callable[..., dict[str, Any]]
    """``(model, backbone dir, HF tensors) -> {our key: tensor}`` (names and shapes checked)."""
    initialised_parts: Callable[[list[str]], list[str]]
    """Module names of the keys left at their initialisation (for the run's line)."""


@dataclass(frozen=True, kw_only=True)
class ExportFormat:
    """A reference format the end of a run writes beside the native export
    (``export.format``; ``auto`` picks the policy's first)."""

    name: str
    """The ``export.format`` value and the sub-folder of the export directory."""
    label: str
    """What it is, for the run's report (e.g. "LeRobot pi0.5")."""
    loaded_by: str
    """What reads it back (e.g. "model.init_from, PI05Policy.from_pretrained")."""
    write: Callable[..., Path]
    """``(export_dir, out_dir, *, root, tokenizer, cameras, stats) -> out_dir``: convert the
    native export of a finished run, with the statistics each sub-dataset was normalised
    with."""
    convert: Callable[..., Path]
    """``(export_dir, out_dir, *, dataset, **options) -> out_dir``: the same from the command
    line (``python -m longboat.embodied.train.lerobot_export``)."""
    unavailable: Callable[[Any, int], str | None] = lambda cfg, num_datasets: None
    """``(family config, sub-datasets) -> why this run cannot be written in it, or None``."""


def flavors_of(config_class: type) -> LazyFlavors:
    """The flavors of a policy config class (``config_class.FLAVORS``: name -> factory), each
    config made when it is looked up."""
    factories: Mapping[str, Callable[[], Any]] = config_class.FLAVORS
    return LazyFlavors(factories, lambda name: factories[name]())


@dataclass(frozen=True, kw_only=True)
class PolicyFamily(Family):
    """Everything longboat-embodied knows about one policy (module doc): core's ``Family``
    with ``stack="embodied"``, ``schema`` the policy's architecture config dataclass (what
    ``model.overrides`` keys name; the ``model`` section itself is ``PolicyModelConfig`` for
    every policy), ``build(config)`` its ``nn.Module`` (usually the class), plus the fields
    only the embodied run reads."""

    stack: str = "embodied"
    """Always ``embodied``."""
    batch_spec: BatchSpecFn | None = None
    """The ``PolicyBatchSpec`` of a config (``BatchSpecFn``); required."""
    flops_per_sample: Callable[..., float] | None = None
    """``(cfg, num_cameras, image_hw, text_len) -> float``: useful training FLOPs of one
    sample (forward, and backward where gradients flow)."""
    action_width_key: str = "action_dim"
    """The config field holding the widest action the policy takes (the state's is
    ``max_state_dim``)."""
    synthetic_image_hw: tuple[int, int] = (56, 56)
    """Frame size of the synthetic dataset (``data.path=null``) and of synthetic batches."""
    prompts: PromptProcessor | None = None
    """Prompts from a Hugging Face tokenizer; None: the byte-level stand-in only."""
    checkpoints: CheckpointAdapter | None = None
    """``model.init_from`` of a released checkpoint; None: not supported."""
    backbones: BackboneAdapter | None = None
    """``model.init_from`` of a Hugging Face backbone; None: not supported."""
    export_formats: tuple[ExportFormat, ...] = ()
    """Reference formats written beside the native export (the first is ``auto``'s)."""
    lora_targets: tuple[str, ...] = ()
    """The linears a LoRA run with ``lora.targets=[]`` adapts, named as PEFT's
    ``target_modules`` does (a module path or its last parts, e.g. ``q_proj``); empty: every
    ``nn.Linear`` of the policy."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stack != "embodied":
            raise ValueError(f"policy {self.name!r}: a PolicyFamily's stack is 'embodied'")
        if self.build is None or self.batch_spec is None:
            raise ValueError(f"policy {self.name!r} needs build and batch_spec")

    @property
    def config_class(self) -> type:
        """The policy's config dataclass (``schema``)."""
        return self.model_schema()

    @property
    def model_class(self) -> Callable[[Any], nn.Module]:
        """What builds the policy from its config (``build``, usually its class)."""
        assert self.build is not None
        return self.build

    def export_format(self, name: str) -> ExportFormat | None:
        """The export format called ``name``, or None."""
        return next((f for f in self.export_formats if f.name == name), None)


__all__ = [
    "BackboneAdapter",
    "CheckpointAdapter",
    "ExportFormat",
    "PolicyBatchSpec",
    "PolicyFamily",
    "PromptProcessor",
    "flavors_of",
]

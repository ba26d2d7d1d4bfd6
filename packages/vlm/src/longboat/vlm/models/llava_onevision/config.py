"""LLaVA-OneVision-style composed VLM config: vision tower + projector + a core decoder.

``LlavaOnevisionConfig`` holds the three parts and the joints between them; ``compose`` builds
one from a run's ``model`` section (``model.vision`` / ``model.projector`` /
``model.language``, each picked with one Hydra config group line) and validates the joints
before anything is built, naming the keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.decoder_flavors import decoder_flavor, decoder_names
from longboat.vlm.models.common import language_from_section, pick_flavor
from longboat.vlm.models.llava_onevision.anyres import max_tiles
from longboat.vlm.models.projector.config import ProjectorConfig
from longboat.vlm.models.siglip.config import VISION_FLAVORS, SiglipVisionConfig

RELEASED_PINPOINTS: tuple[tuple[int, int], ...] = tuple(
    (384 * r, 384 * c) for r in range(1, 7) for c in range(1, 7)
)
"""``image_grid_pinpoints`` of the released LLaVA-OneVision models (1x1 .. 6x6 tiles of 384)."""

TINY_PINPOINTS: tuple[tuple[int, int], ...] = tuple(
    (16 * r, 16 * c) for r in range(1, 4) for c in range(1, 4)
)
"""1x1 .. 3x3 tiles of the tiny tower's 16-pixel crops."""


@dataclass
class LlavaOnevisionConfig:
    """A composed VLM: ``vision`` -> ``projector`` -> ``language``, with anyres image tiling."""

    language: DecoderModelConfig
    """Any registered core decoder family (1D rotary: ``mrope_section`` is None)."""
    vision: SiglipVisionConfig
    projector: ProjectorConfig
    """Widths resolved: ``input_size`` = the tower's, ``output_size`` = the decoder's."""
    image_token_id: int = 151646
    video_token_id: int = 151647
    image_grid_pinpoints: tuple[tuple[int, int], ...] = RELEASED_PINPOINTS
    """Tile grid resolutions ``(height, width)`` in pixels, multiples of the crop size."""
    vision_aspect_ratio: str = "anyres_max_9"
    """``anyres_max_N``: tile feature maps larger than ~N tiles are shrunk bilinearly."""
    vision_feature_layer: int = -1
    """Which hidden state of the tower feeds the projector (-1: the last block's output)."""
    vision_feature_select_strategy: str = "full"
    """Which tokens of that state: ``full`` (all; SigLIP has no class token)."""

    position_kind = "1d"
    """Position ids of the decoder (the data pipeline reads it): one stream, per sample."""

    @property
    def tokens_per_second(self) -> int:
        """No temporal positions (1D rotary); kept for the data pipeline's interface."""
        return 1

    def vision_processor(self, data: Any = None) -> Any:
        """The image processor of this model (crop size, tile grids, anyres rule)."""
        from longboat.vlm.data.llava_processor import LlavaProcessorConfig, LlavaVisionProcessor

        return LlavaVisionProcessor(
            LlavaProcessorConfig(
                crop_size=self.vision.image_size,
                patch_size=self.vision.patch_size,
                image_grid_pinpoints=self.image_grid_pinpoints,
                vision_aspect_ratio=self.vision_aspect_ratio,
            )
        )

    @property
    def feature_layers(self) -> int:
        """Blocks of the tower that run (hidden state ``vision_feature_layer``)."""
        k = self.vision_feature_layer
        return k if k >= 0 else self.vision.num_layers + 1 + k

    def architecture(self) -> dict[str, Any]:
        """What a checkpoint's weights and config fix."""
        fields = dataclasses.asdict(self)
        fields["language"] = self.language.architecture()
        fields["image_grid_pinpoints"] = [list(p) for p in self.image_grid_pinpoints]
        return fields

    def validate(self) -> None:
        """Raise one ``ConfigError`` naming every joint that does not fit."""
        lang = self.language
        if lang.name not in decoder_names():
            raise ConfigError(
                f"model.language.name={lang.name!r}: unknown decoder family",
                fix=f"use one of {decoder_names()} (model/llm@model.language=<option>)",
            )
        lang.validate(prefix="model.language")
        self.vision.validate()
        self.projector.validate()
        problems = []
        p, v = self.projector, self.vision
        if p.input_size != v.hidden_size:
            problems.append(
                f"model.projector.input_size={p.input_size} must equal model.vision.hidden_size="
                f"{v.hidden_size} (the projector reads the tower's features)"
            )
        if p.output_size != lang.hidden_size:
            problems.append(
                f"model.projector.output_size={p.output_size} must equal "
                f"model.language.hidden_size={lang.hidden_size} (the projector feeds the decoder)"
            )
        if lang.mrope_section is not None:
            problems.append(
                f"model.language.mrope_section={lang.mrope_section}: this family uses 1D "
                "rotary positions; set it to null"
            )
        for key in ("image_token_id", "video_token_id"):
            value = getattr(self, key)
            if not 0 <= value < lang.vocab_size:
                problems.append(
                    f"model.{key}={value}: outside the vocabulary (model.language.vocab_size="
                    f"{lang.vocab_size})"
                )
        crop = v.image_size
        bad = [
            list(x) for x in self.image_grid_pinpoints if x[0] % crop or x[1] % crop or min(x) < 1
        ]
        if bad or not self.image_grid_pinpoints:
            problems.append(
                f"model.image_grid_pinpoints has {bad or 'no entries'}: every (height, width) "
                f"must be a positive multiple of model.vision.image_size={crop}"
            )
        try:
            max_tiles(self.vision_aspect_ratio)
        except ValueError as exc:
            problems.append(f"model.{exc}")
        if not 0 < self.feature_layers <= v.num_layers:
            problems.append(
                f"model.vision_feature_layer={self.vision_feature_layer}: must pick one of the "
                f"tower's {v.num_layers} blocks' outputs (1..{v.num_layers} or -1..-{v.num_layers})"
            )
        if self.vision_feature_select_strategy != "full":
            problems.append(
                f"model.vision_feature_select_strategy={self.vision_feature_select_strategy!r}: "
                "only 'full' is implemented"
            )
        if problems:
            raise ConfigError("; ".join(problems))


def _vision(raw: Mapping[str, Any], base: SiglipVisionConfig) -> SiglipVisionConfig:
    """``model.vision``: ``flavor`` picks a tower flavor, other keys override it."""
    raw = dict(raw)
    flavor = raw.pop("flavor", None)
    if flavor is not None:
        if flavor not in VISION_FLAVORS:
            raise ConfigError(
                f"model.vision.flavor={flavor!r}: SigLIP has flavors {sorted(VISION_FLAVORS)}",
                fix="pick one of them",
            )
        base = VISION_FLAVORS[flavor]
    return SiglipVisionConfig.from_mapping(raw, base=base)


def compose(
    base: LlavaOnevisionConfig,
    *,
    vision: Mapping[str, Any] | None = None,
    projector: Mapping[str, Any] | None = None,
    language: Mapping[str, Any] | None = None,
    **fields: Any,
) -> LlavaOnevisionConfig:
    """``base`` with the given sections laid over it, the projector's widths resolved, and
    validated (``ConfigError`` naming the keys of every joint that does not fit). A tower
    with another crop size keeps ``base``'s tile grids, in its own crops."""
    lang = language_from_section(language or {}, base.language)
    tower = _vision(vision or {}, base.vision)
    proj_base = dataclasses.replace(base.projector, input_size=None, output_size=None)
    proj = ProjectorConfig.from_mapping(projector or {}, base=proj_base)
    proj = proj.resolved(tower.hidden_size, lang.hidden_size)
    if "image_grid_pinpoints" in fields:
        fields["image_grid_pinpoints"] = tuple(
            (int(h), int(w)) for h, w in fields["image_grid_pinpoints"]
        )
    elif tower.image_size != base.vision.image_size:
        # Another crop size keeps the flavor's tile grids (1x1 .. NxM tiles of the new crop).
        old, new = base.vision.image_size, tower.image_size
        fields["image_grid_pinpoints"] = tuple(
            (h // old * new, w // old * new) for h, w in base.image_grid_pinpoints
        )
    cfg = dataclasses.replace(base, language=lang, vision=tower, projector=proj, **fields)
    cfg.validate()
    return cfg


def _flavors() -> dict[str, LlavaOnevisionConfig]:
    def released(language: DecoderModelConfig) -> LlavaOnevisionConfig:
        vision = VISION_FLAVORS["so400m"]
        return LlavaOnevisionConfig(
            language=language,
            vision=vision,
            projector=ProjectorConfig().resolved(vision.hidden_size, language.hidden_size),
        )

    tiny_language = dataclasses.replace(decoder_flavor("qwen2", "tiny"), vocab_size=384)
    tiny_vision = VISION_FLAVORS["tiny"]
    return {
        "tiny": LlavaOnevisionConfig(
            language=tiny_language,
            vision=tiny_vision,
            projector=ProjectorConfig().resolved(
                tiny_vision.hidden_size, tiny_language.hidden_size
            ),
            image_token_id=310,
            video_token_id=311,
            image_grid_pinpoints=TINY_PINPOINTS,
        ),
        "0.5b": released(decoder_flavor("qwen2", "0.5b")),
        "7b": released(decoder_flavor("qwen2", "7b")),
    }


FLAVORS = ("tiny", "0.5b", "7b")


def flavor(name: str) -> LlavaOnevisionConfig:
    """Flavor ``name``: ``tiny`` (CPU tests), ``0.5b``, ``7b`` (SigLIP so400m + Qwen2)."""
    return pick_flavor(_flavors(), name, "llava_onevision")

"""Qwen3-VL (dense): the ViT (``vision.py``) + core's ``qwen3`` decoder with interleaved
M-RoPE and deepstack features added after its first layers (``deepstack.py``).

``Qwen3VLConfig`` holds the two parts and the placeholder token ids; ``read_hf_config``
fills it from a ``Qwen3VLForConditionalGeneration`` ``config.json``; ``build`` builds this
rank's model (megatron parallel state first); ``load_hf`` / ``save_hf`` read and write the
Hugging Face layout (``model.language_model.*`` decoder, ``model.visual.*`` tower,
``lm_head``), which ``transformers`` loads.

The decoder's rotary is megatron's ``MultimodalRotaryEmbedding`` given the run lengths of
Qwen3-VL's interleaved layout (``interleaved_mrope_sections``) instead of three blocks; the
position ids are Qwen3-VL's (each frame group of a video its own run behind its timestamp).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.decoder_flavors import decoder_flavor
from longboat.core.megatron.hf_decoder_config import hf_dialect
from longboat.vlm.models.common import (
    build_decoder_stage,
    build_split_tower,
    check_checkpoint_architecture,
    check_model_type,
    check_recompute,
    load_decoder_and_tower,
    pick_flavor,
    read_config_json,
    save_decoder_and_tower,
    tower_hf_state,
)
from longboat.vlm.models.mrope import (
    interleaved_mrope_sections,
    interleaved_mrope_streams,
    mrope_position_ids,
)
from longboat.vlm.models.peft_layout import PeftLayout
from longboat.vlm.models.qwen3_vl.vision_config import Qwen3VisionConfig, vision_flavor
from longboat.vlm.models.tower_memory import qwen3_tower_shapes

if TYPE_CHECKING:  # megatron is imported when a model is built, not to read a config
    from longboat.vlm.models.vlm import VisionLanguageModel

HF_MODEL_TYPE = "qwen3_vl"
PIPELINE_PARALLEL = True
"""``build`` / ``load_hf`` / ``save_hf`` work per pipeline stage (the ViT on the first, which
must also hold the decoder layers that take deepstack features)."""
VISION_DATA_PARALLEL = True
"""``build(vision_tensor_parallel=1)`` under a TP decoder: an unsharded tower encoding the
images data-parallel over the TP ranks (``longboat.vlm.models.vision_parallel``)."""
PEFT_LAYOUT = PeftLayout(
    language="model.language_model.",
    vision=("model.visual",),
    projector=("model.visual.merger", "model.visual.deepstack_merger_list."),
)
"""``transformers``' ``Qwen3VLForConditionalGeneration`` module names: the decoder's layers,
the tower, its patch merger and each deepstack merger (what a PEFT adapter of a LoRA run
names)."""
QWEN3_VL_MROPE = [24, 20, 20]
"""transformers' default M-RoPE sections for Qwen3-VL (head_dim 128) when the config has none."""


@dataclass
class Qwen3VLConfig:
    """A Qwen3-VL dense model: decoder, vision tower and the special token ids."""

    language: DecoderModelConfig
    """The ``qwen3`` decoder (``mrope_section`` set; its layout is interleaved)."""
    vision: Qwen3VisionConfig
    """The ViT with its mergers (``out_hidden_size`` = the decoder's width)."""
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    decoder = "qwen3"
    """The decoder kind this family composes (``model.language.name``)."""
    position_kind = "mrope_frames"
    """Position ids of packed rows (the data pipeline reads it): M-RoPE with each frame
    group of a video placed like a one-frame image, as ``build``'s model computes them."""

    def architecture(self) -> dict[str, Any]:
        """What a checkpoint's weights and config fix (the flavor name and init excluded)."""
        fields = dataclasses.asdict(self)
        fields["language"] = self.language.architecture()
        return fields

    def validate(self) -> None:
        """Raise ``ConfigError`` naming each joint that does not fit."""
        self.language.validate(prefix="model.language")
        self.vision.validate()
        problems = []
        lang = self.language
        if self.vision.out_hidden_size != lang.hidden_size:
            problems.append(
                f"model.vision.out_hidden_size={self.vision.out_hidden_size} must equal "
                f"model.language.hidden_size={lang.hidden_size} (the mergers feed the decoder)"
            )
        if lang.name != self.decoder:
            problems.append(
                f"model.language.name={lang.name!r}: this family's decoder is {self.decoder}"
            )
        section = lang.mrope_section
        if section is None:
            problems.append("model.language.mrope_section: required (Qwen3-VL uses M-RoPE)")
        else:
            streams = interleaved_mrope_streams(section, lang.head_dim)
            counts = [streams.count(s) for s in range(3)]
            if counts != list(section):
                problems.append(
                    f"model.language.mrope_section={list(section)}: the interleaved layout "
                    f"gives the time / height / width streams {counts} frequencies (height "
                    "and width take every third one from the second / third on, time the "
                    "rest); use sections whose temporal part is at least the others"
                )
        n = len(self.vision.deepstack_visual_indexes)
        if n > lang.num_layers:
            problems.append(
                f"model.vision.deepstack_visual_indexes has {n} entries but the decoder has "
                f"model.language.num_layers={lang.num_layers} layers to add them to"
            )
        vocab = lang.vocab_size
        for key in ("image_token_id", "video_token_id", "vision_start_token_id"):
            value = getattr(self, key)
            if not 0 <= value < vocab:
                problems.append(f"model.{key}={value}: outside the vocabulary (size {vocab})")
        if problems:
            raise ConfigError("; ".join(problems))

    def vision_processor(self, data: Any) -> Any:
        """The processor of this model for a run's ``data`` section: Qwen2-VL-style image
        resizing with this tower's patch and merge sizes, ``data.min_pixels`` /
        ``data.max_pixels`` and Qwen3-VL's normalisation; videos as Qwen3-VL's video
        processor with its released settings (``Qwen3VLVisionProcessor``)."""
        from longboat.vlm.models.qwen3_vl.processor import qwen3_vl_processor

        return qwen3_vl_processor(self.vision, data.min_pixels, data.max_pixels)


def mrope_from_text_config(text: dict[str, Any], where: str) -> tuple[dict[str, Any], list[int]]:
    """``(text config without the M-RoPE keys, mrope_section)``; transformers' Qwen3-VL
    always interleaves, so ``mrope_interleaved: false`` is refused rather than ignored."""
    text = dict(text)
    section = None
    for key in ("rope_parameters", "rope_scaling"):
        params = dict(text.get(key) or {})
        if "mrope_section" in params:
            section = [int(x) for x in params.pop("mrope_section")]
        if params.pop("mrope_interleaved", True) is False:
            raise ConfigError(
                f"{where}: text_config.{key}.mrope_interleaved=false: Qwen3-VL's M-RoPE is "
                "interleaved (transformers ignores the flag and interleaves too)",
                fix="drop the key or set it to true",
            )
        if params.get("rope_type", params.get("type")) == "mrope":
            params["rope_type"] = "default"
            params.pop("type", None)
        if params:
            text[key] = params
        else:
            text.pop(key, None)
    if section is not None and len(section) != 3:
        raise ConfigError(f"{where}: mrope_section={section!r}: expected three sizes")
    return text, section if section is not None else list(QWEN3_VL_MROPE)


def read_hf_config(source: str | Path | dict[str, Any]) -> Qwen3VLConfig:
    """The config of a Qwen3-VL ``config.json`` (a directory or the parsed dict)."""
    hf, where = read_config_json(source, "Hugging Face Qwen3-VL")
    check_model_type(
        hf,
        where,
        HF_MODEL_TYPE,
        fix="point at a Qwen3VLForConditionalGeneration checkpoint (Qwen3-VL dense)",
    )
    return config_from_hf(hf, where, Qwen3VLConfig, name="Qwen3-VL")


def config_from_hf(
    hf: dict[str, Any],
    where: str,
    config_cls: type[Qwen3VLConfig],
    *,
    name: str,
    text_overrides: dict[str, Any] | None = None,
) -> Any:
    """A Qwen3-VL-style model config (``config_cls``, whose ``decoder`` names the text
    dialect) from a parsed ``config.json``: its text config (plus ``text_overrides``) through
    that dialect with the M-RoPE sections, the tower's config and the token ids; validated."""
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ConfigError(f"{where}: no text_config", fix=f"a {name} config.json has one")
    text, section = mrope_from_text_config(text, where)
    text["model_type"] = config_cls.decoder
    text.update(text_overrides or {})
    text["tie_word_embeddings"] = bool(
        hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    )
    language = hf_dialect(config_cls.decoder).from_hf_config(text)
    cfg = config_cls(
        language=dataclasses.replace(language, mrope_section=section),
        vision=Qwen3VisionConfig.from_hf(dict(hf.get("vision_config") or {})),
        image_token_id=int(hf.get("image_token_id", 151655)),
        video_token_id=int(hf.get("video_token_id", 151656)),
        vision_start_token_id=int(hf.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(hf.get("vision_end_token_id", 151653)),
    )
    cfg.validate()
    return cfg


def hf_text_config(cfg: Qwen3VLConfig) -> dict[str, Any]:
    """The ``text_config`` of a Qwen3-VL-style HF config: the decoder's common fields with
    the interleaved M-RoPE sections (tying is the outer config's)."""
    from longboat.core.megatron.hf_decoder_config import common_to_hf

    lang = cfg.language
    text = common_to_hf(lang)
    text.pop("tie_word_embeddings")
    text["rope_parameters"] = {
        **text["rope_parameters"],
        "mrope_section": list(lang.mrope_section or []),
        "mrope_interleaved": True,
    }
    return text


def hf_outer_fields(cfg: Qwen3VLConfig) -> dict[str, Any]:
    """The outer HF config's fields besides ``text_config`` and ``architectures``: the
    tower's config, the token ids and tying."""
    return dict(
        vision_config=cfg.vision.to_hf(),
        image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id,
        vision_start_token_id=cfg.vision_start_token_id,
        vision_end_token_id=cfg.vision_end_token_id,
        tie_word_embeddings=cfg.language.tie_embeddings,
    )


def to_hf_config(cfg: Qwen3VLConfig) -> Any:
    """``transformers.Qwen3VLConfig`` for ``cfg``."""
    from transformers import Qwen3VLConfig as HFConfig

    return HFConfig(
        text_config=hf_text_config(cfg),
        **hf_outer_fields(cfg),
        architectures=["Qwen3VLForConditionalGeneration"],
    )


def build(
    cfg: Qwen3VLConfig,
    *,
    precision: str = "fp32",
    device_type: str = "cpu",
    kernels: Any = None,
    recompute: tuple[str, ...] = (),
    vision_tensor_parallel: int | None = None,
) -> VisionLanguageModel:
    """This rank's Qwen3-VL (one pipeline stage; megatron parallel state initialised).

    With pipeline parallelism the ViT lives on the first stage, which must hold every
    decoder layer that takes a deepstack feature; interleaved virtual stages are refused.
    ``recompute``: ``vision`` (each ViT block) and / or ``language`` (each decoder layer).
    ``vision_tensor_parallel``: the tower's TP size, null (the decoder's) or 1 (unsharded,
    the images divided over the decoder's TP ranks; collective over the world).
    """
    from megatron.core import parallel_state as mps

    from longboat.vlm.models.qwen3_vl.deepstack import Qwen3VLModel, add_deepstack_hooks
    from longboat.vlm.models.qwen3_vl.vision import Qwen3VisionModel
    from longboat.vlm.models.vision_parallel import vision_split

    cfg.validate()
    lang, n_deep = cfg.language, len(cfg.vision.deepstack_visual_indexes)
    pp = mps.get_pipeline_model_parallel_world_size()
    if pp > 1 and lang.num_layers // pp < n_deep:
        raise ConfigError(
            f"the first pipeline stage holds {lang.num_layers // pp} decoder layers but the "
            f"{n_deep} deepstack features are added after the first {n_deep}",
            key="parallel.pipeline_parallel",
            value=pp,
            fix=f"use at most {lang.num_layers // n_deep} stages",
        )
    check_recompute(recompute)
    decoder = build_decoder_stage(
        lang, kernels=kernels, precision=precision, device_type=device_type, recompute=recompute,
        mrope_section=interleaved_mrope_sections(lang.mrope_section or [], lang.head_dim),
    )  # fmt: skip
    add_deepstack_hooks(decoder, n_deep)
    split = vision_split(vision_tensor_parallel)
    vision = build_split_tower(
        Qwen3VisionModel, cfg.vision, first_stage=decoder.pre_process, split=split,
        precision=precision, device_type=device_type, kernels=kernels, recompute=recompute,
    )  # fmt: skip
    position_ids = partial(
        mrope_position_ids,
        image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id,
        spatial_merge_size=cfg.vision.spatial_merge_size,
        tokens_per_second=1.0,  # unused: each frame group is its own run
        frames_as_runs=True,
    )
    return Qwen3VLModel(
        vision,
        decoder,
        image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id,
        position_ids=position_ids,
        vision_split=split,
    )


@torch.no_grad()
def load_hf(model: VisionLanguageModel, cfg: Qwen3VLConfig, hf_dir: str | Path) -> int:
    """Load a Hugging Face Qwen3-VL directory into this rank's model after checking that
    its config describes ``cfg``; returns the number of tensors read. A checkpoint that does
    not fit raises naming every missing, unexpected and wrongly shaped tensor."""
    from longboat.vlm.models.qwen3_vl import vision_hf

    check_checkpoint_architecture(cfg.architecture(), read_hf_config(hf_dir).architecture(), hf_dir)
    return load_decoder_and_tower(model, cfg, hf_dir, vision_hf)


def save_hf(model: VisionLanguageModel, cfg: Qwen3VLConfig, out_dir: str | Path) -> Path:
    """Write ``config.json`` + the safetensors weights in the layout ``transformers`` loads
    (collective over the world: ``common.save_decoder_and_tower``)."""
    from longboat.vlm.models.qwen3_vl import vision_hf

    return save_decoder_and_tower(
        model,
        cfg,
        out_dir,
        vision_hf,
        to_hf_config,
        language_prefix="model.language_model.",
        visual_prefix="model.visual.",
    )


def visual_hf_state(model: VisionLanguageModel, cfg: Qwen3VLConfig) -> dict[str, torch.Tensor]:
    """The tower with its mergers as full tensors named after ``transformers``' modules
    (``model.visual.*``); collective over the TP group like ``save_hf``, empty where the
    model has no tower (a later pipeline stage)."""
    from longboat.vlm.models.qwen3_vl import vision_hf

    return tower_hf_state(model, cfg.vision, vision_hf, "model.visual.")


def _flavors() -> dict[str, Qwen3VLConfig]:
    vl = dict(max_position_embeddings=262144, rope_theta=5000000.0,
              mrope_section=list(QWEN3_VL_MROPE))  # fmt: skip
    # 4 decoder layers: 2 take deepstack features, and a pipeline split keeps them together.
    tiny_language = dataclasses.replace(
        decoder_flavor("qwen3", "tiny"), vocab_size=384, num_layers=4, mrope_section=[4, 2, 2]
    )
    return {
        "tiny": Qwen3VLConfig(
            language=tiny_language,
            vision=vision_flavor("tiny").replace(out_hidden_size=tiny_language.hidden_size),
            image_token_id=310,
            video_token_id=311,
            vision_start_token_id=312,
            vision_end_token_id=313,
        ),
        # The decoders of the released checkpoints are Qwen3-1.7B / 4B / 8B shaped.
        "2b": Qwen3VLConfig(
            language=dataclasses.replace(decoder_flavor("qwen3", "1.7b"), flavor="vl_2b", **vl),
            vision=vision_flavor("2b"),
        ),
        "4b": Qwen3VLConfig(
            language=dataclasses.replace(
                decoder_flavor("qwen3", "1.7b"),
                flavor="vl_4b",
                hidden_size=2560,
                num_layers=36,
                num_attention_heads=32,
                ffn_hidden_size=9728,
                **vl,
            ),
            vision=vision_flavor("4b"),
        ),
        "8b": Qwen3VLConfig(
            language=dataclasses.replace(decoder_flavor("qwen3", "8b"), flavor="vl_8b", **vl),
            vision=vision_flavor("8b"),
        ),
    }


FLAVORS = ("tiny", "2b", "4b", "8b")
tower_shapes = qwen3_tower_shapes
"""The tower as the memory plan reads it (``tower_memory``)."""


def flavor(name: str) -> Qwen3VLConfig:
    """Qwen3-VL flavor ``name``: ``tiny`` (CPU tests), ``2b``, ``4b``, ``8b`` (as released)."""
    return pick_flavor(_flavors(), name, "Qwen3-VL")

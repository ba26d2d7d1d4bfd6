"""Qwen2.5-VL: the ViT (``vision.py``) + core's ``qwen2`` decoder with M-RoPE.

``Qwen25VLConfig`` holds the two parts and the placeholder token ids; ``read_hf_config``
fills it from a ``Qwen2_5_VLForConditionalGeneration`` ``config.json``; ``build_qwen2_5_vl``
builds this rank's model (megatron parallel state first); ``load_hf`` / ``save_hf`` read and
write the Hugging Face directory layout (``model.*`` decoder, ``visual.*`` tower,
``lm_head``), which ``transformers`` loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

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
from longboat.vlm.models.mrope import mrope_position_ids
from longboat.vlm.models.peft_layout import PeftLayout
from longboat.vlm.models.qwen2_5_vl.vision_config import Qwen25VisionConfig
from longboat.vlm.models.tower_memory import qwen2_5_tower_shapes
from longboat.vlm.models.vlm import VisionLanguageModel

HF_MODEL_TYPE = "qwen2_5_vl"
PIPELINE_PARALLEL = True
"""``build`` / ``load_hf`` / ``save_hf`` work per pipeline stage (the ViT on the first)."""
VISION_DATA_PARALLEL = True
"""``build(vision_tensor_parallel=1)`` under a TP decoder: an unsharded tower encoding the
images data-parallel over the TP ranks (``longboat.vlm.models.vision_parallel``)."""
PEFT_LAYOUT = PeftLayout(
    language="model.language_model.", vision=("model.visual",), projector=("model.visual.merger",)
)
"""``transformers``' ``Qwen2_5_VLForConditionalGeneration`` module names: the decoder's layers,
the tower and its patch merger (what a PEFT adapter of a LoRA run names)."""


@dataclass
class Qwen25VLConfig:
    """A Qwen2.5-VL model: decoder, vision tower and the special token ids."""

    language: DecoderModelConfig
    """The ``qwen2`` decoder (``mrope_section`` set)."""
    vision: Qwen25VisionConfig
    """The ViT with its patch merger (``out_hidden_size`` = the decoder's width)."""
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tokens_per_second: int = 2
    """Temporal M-RoPE step per second of video (HF ``vision_config.tokens_per_second``)."""

    def architecture(self) -> dict[str, Any]:
        """What a checkpoint's weights and config fix (the flavor name and init excluded)."""
        fields = dataclasses.asdict(self)
        fields["language"] = self.language.architecture()
        return fields

    def validate(self) -> None:
        """Raise ``ConfigError`` naming each joint that does not fit."""
        self.language.validate(prefix="model.language")
        problems = []
        if self.vision.out_hidden_size != self.language.hidden_size:
            problems.append(
                f"model.vision.out_hidden_size={self.vision.out_hidden_size} must equal "
                f"model.language.hidden_size={self.language.hidden_size} (the merger feeds "
                "the decoder)"
            )
        if self.language.mrope_section is None:
            problems.append("model.language.mrope_section: required (Qwen2.5-VL uses M-RoPE)")
        vocab = self.language.vocab_size
        for key in ("image_token_id", "video_token_id", "vision_start_token_id"):
            value = getattr(self, key)
            if not 0 <= value < vocab:
                problems.append(f"model.{key}={value}: outside the vocabulary (size {vocab})")
        if problems:
            raise ConfigError("; ".join(problems))


def read_hf_config(source: str | Path | dict[str, Any]) -> Qwen25VLConfig:
    """The config of a Qwen2.5-VL ``config.json`` (a directory or the parsed dict)."""
    hf, where = read_config_json(source, "Hugging Face Qwen2.5-VL")
    check_model_type(
        hf, where, HF_MODEL_TYPE, fix="point at a Qwen2_5_VLForConditionalGeneration checkpoint"
    )
    text = dict(hf.get("text_config") or {})
    if not text:  # transformers 4.x kept the decoder fields at the top level
        text = {k: v for k, v in hf.items() if k != "vision_config"}
    text["model_type"] = "qwen2_5_vl_text"
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text["tie_word_embeddings"] = bool(tie)
    language = hf_dialect("qwen2").from_hf_config(text)
    vision_hf = dict(hf.get("vision_config") or {})
    cfg = Qwen25VLConfig(
        language=language,
        vision=Qwen25VisionConfig.from_hf(vision_hf),
        image_token_id=int(hf.get("image_token_id", 151655)),
        video_token_id=int(hf.get("video_token_id", 151656)),
        vision_start_token_id=int(hf.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(hf.get("vision_end_token_id", 151653)),
        tokens_per_second=int(vision_hf.get("tokens_per_second", 2)),
    )
    cfg.validate()
    return cfg


def to_hf_config(cfg: Qwen25VLConfig) -> Any:
    """``transformers.Qwen2_5_VLConfig`` for ``cfg``."""
    from transformers import Qwen2_5_VLConfig

    lang = cfg.language
    text = hf_dialect("qwen2").to_hf_config(dataclasses.replace(lang, mrope_section=None))
    text_dict = {
        k: v
        for k, v in text.to_dict().items()
        if k not in ("architectures", "model_type", "transformers_version", "tie_word_embeddings")
    }
    text_dict["rope_parameters"] = {
        **text_dict["rope_parameters"],
        "mrope_section": list(lang.mrope_section or []),
    }
    vision = {**cfg.vision.to_hf(), "tokens_per_second": cfg.tokens_per_second}
    return Qwen2_5_VLConfig(
        text_config=text_dict,
        vision_config=vision,
        image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id,
        vision_start_token_id=cfg.vision_start_token_id,
        vision_end_token_id=cfg.vision_end_token_id,
        tie_word_embeddings=lang.tie_embeddings,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )


def build_qwen2_5_vl(
    cfg: Qwen25VLConfig,
    *,
    precision: str = "fp32",
    device_type: str = "cpu",
    kernels: Any = None,
    recompute: tuple[str, ...] = (),
    vision_tensor_parallel: int | None = None,
) -> VisionLanguageModel:
    """This rank's Qwen2.5-VL (one pipeline stage; megatron parallel state initialised).

    With pipeline parallelism the ViT lives on the first stage only and the decoder layers
    are split evenly over the stages (interleaved virtual stages are refused).

    ``recompute``: components whose activations are recomputed in the backward instead of
    kept, ``vision`` (each ViT block) and ``language`` (each decoder layer).
    ``vision_tensor_parallel``: the tower's TP size, null (the decoder's) or 1 (unsharded,
    the images divided over the decoder's TP ranks; collective over the world).
    """
    from longboat.vlm.models.qwen2_5_vl.vision import Qwen25VisionModel
    from longboat.vlm.models.vision_parallel import vision_split

    cfg.validate()
    check_recompute(recompute)
    decoder = build_decoder_stage(
        cfg.language,
        kernels=kernels,
        precision=precision,
        device_type=device_type,
        recompute=recompute,
    )
    split = vision_split(vision_tensor_parallel)
    vision = build_split_tower(
        Qwen25VisionModel,
        cfg.vision,
        first_stage=decoder.pre_process,
        split=split,
        precision=precision,
        device_type=device_type,
        kernels=kernels,
        recompute=recompute,
    )
    position_ids = partial(
        mrope_position_ids,
        image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id,
        spatial_merge_size=cfg.vision.spatial_merge_size,
        tokens_per_second=cfg.tokens_per_second,
    )
    model = VisionLanguageModel(
        vision,
        decoder,
        image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id,
        position_ids=position_ids,
        vision_split=split,
    )
    return model


@torch.no_grad()
def load_hf(model: VisionLanguageModel, cfg: Qwen25VLConfig, hf_dir: str | Path) -> int:
    """Load a Hugging Face Qwen2.5-VL directory into this rank's model after checking that
    its config describes ``cfg``; returns the number of tensors read. A checkpoint that does
    not fit raises naming every missing, unexpected and wrongly shaped tensor."""
    from longboat.vlm.models.qwen2_5_vl import vision_hf

    check_checkpoint_architecture(cfg.architecture(), read_hf_config(hf_dir).architecture(), hf_dir)
    return load_decoder_and_tower(model, cfg, hf_dir, vision_hf)


def save_hf(model: VisionLanguageModel, cfg: Qwen25VLConfig, out_dir: str | Path) -> Path:
    """Write ``config.json`` + the safetensors weights in the layout ``transformers`` loads
    (collective over the world: ``common.save_decoder_and_tower``)."""
    from longboat.vlm.models.qwen2_5_vl import vision_hf

    return save_decoder_and_tower(
        model,
        cfg,
        out_dir,
        vision_hf,
        to_hf_config,
        language_prefix="model.",
        visual_prefix="visual.",
    )


def visual_hf_state(model: VisionLanguageModel, cfg: Qwen25VLConfig) -> dict[str, torch.Tensor]:
    """The tower with its merger as full tensors named after ``transformers``' modules
    (``model.visual.*``); collective over the TP group like ``save_hf``, empty where the
    model has no tower (a later pipeline stage)."""
    from longboat.vlm.models.qwen2_5_vl import vision_hf

    return tower_hf_state(model, cfg.vision, vision_hf, "model.visual.")


def _flavors() -> dict[str, Qwen25VLConfig]:
    from longboat.vlm.models.qwen2_5_vl.vision_config import vision_flavor

    # rope_theta 10: at head_dim 16 the M-RoPE height and width streams get the 6 lowest of
    # the 8 frequencies; at qwen2's 1e6 they turn by under 0.03 rad per merged patch (width
    # under 2e-4), so a 7-token image grid has no readable position. At 10 they turn by
    # 0.13-0.56 rad per patch.
    tiny_language = dataclasses.replace(
        decoder_flavor("qwen2", "tiny"), vocab_size=384, mrope_section=[2, 3, 3], rope_theta=10.0
    )
    return {
        "tiny": Qwen25VLConfig(
            language=tiny_language,
            vision=vision_flavor("tiny").replace(out_hidden_size=tiny_language.hidden_size),
            image_token_id=310,
            video_token_id=311,
            vision_start_token_id=312,
            vision_end_token_id=313,
        ),
        "3b": Qwen25VLConfig(language=decoder_flavor("qwen2", "vl_3b"), vision=vision_flavor("3b")),
        "7b": Qwen25VLConfig(language=decoder_flavor("qwen2", "vl_7b"), vision=vision_flavor("7b")),
    }


FLAVORS = ("tiny", "3b", "7b")
tower_shapes = qwen2_5_tower_shapes
"""The tower as the memory plan reads it (``tower_memory``)."""
build = build_qwen2_5_vl
"""The registry's name for ``build_qwen2_5_vl``."""


def flavor(name: str) -> Qwen25VLConfig:
    """Qwen2.5-VL flavor ``name``: ``tiny`` (CPU tests), ``3b``, ``7b`` (as released)."""
    return pick_flavor(_flavors(), name, "Qwen2.5-VL")

"""Qwen3-VL-MoE: Qwen3-VL's tower (``qwen3_vl.vision``) with its deepstack mergers over
core's ``qwen3_moe`` decoder (every layer sparse), interleaved M-RoPE and deepstack features
added after the first decoder layers, as the dense family builds them (``qwen3_vl.build``).

``Qwen3VLMoeConfig`` is the dense family's config with a ``qwen3_moe`` decoder;
``from_model_config`` composes it from a run's ``model`` section, so one config line swaps
the decoder (``model/llm@model.language=qwen3_moe_30b_a3b``); ``read_hf_config`` /
``to_hf_config`` read and write a ``Qwen3VLMoeForConditionalGeneration`` ``config.json``;
``load_hf`` / ``save_hf`` the weights (``model.language_model.*`` decoder with each layer's
experts as two fused tensors, ``model.visual.*`` tower, ``lm_head``). The routed experts run
expert-parallel over ``parallel.expert_parallel`` ranks (megatron's all-to-all dispatcher).

Load balancing: transformers' router always renormalises the top-k probabilities; with
``router_aux_loss_coef > 0`` the decoder trains with megatron's per-layer load-balancing
loss (``moe_aux_loss_coeff``: each layer's ``coeff * E / k * sum_e f_e P_e``, i.e. ``coeff /
k`` times transformers' term of that layer alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.decoder_flavors import decoder_flavor
from longboat.vlm.models.common import (
    check_checkpoint_architecture,
    check_model_type,
    language_from_section,
    load_decoder_and_tower,
    pick_flavor,
    read_config_json,
    save_decoder_and_tower,
    tower_hf_state,
)
from longboat.vlm.models.qwen3_vl.model import (
    QWEN3_VL_MROPE,
    Qwen3VLConfig,
    config_from_hf,
    hf_outer_fields,
    hf_text_config,
)
from longboat.vlm.models.qwen3_vl.vision_config import Qwen3VisionConfig, vision_flavor
from longboat.vlm.models.tower_memory import qwen3_tower_shapes

if TYPE_CHECKING:  # megatron is imported when a model is built, not to read a config
    from longboat.vlm.models.vlm import VisionLanguageModel

HF_MODEL_TYPE = "qwen3_vl_moe"
EXPERT_LAYOUT = "fused"
"""How the checkpoints store the experts (core's ``hf_mapping.EXPERT_LAYOUTS``)."""
PIPELINE_PARALLEL = True
"""``build`` / ``load_hf`` / ``save_hf`` work per pipeline stage, as the dense family's (the
ViT on the first stage, which must hold the decoder layers that take deepstack features)."""
VISION_DATA_PARALLEL = True
"""``build(vision_tensor_parallel=1)`` under a TP decoder, as the dense family."""
tower_shapes = qwen3_tower_shapes
"""The memory plan's estimate of the tower: the dense family's (the same ViT and mergers)."""


@dataclass
class Qwen3VLMoeConfig(Qwen3VLConfig):
    """A Qwen3-VL-MoE model: the ``qwen3_moe`` decoder, the Qwen3-VL tower and token ids."""

    decoder = "qwen3_moe"

    def validate(self) -> None:
        """The dense family's joints, plus transformers' router: top-k renormalised."""
        super().validate()
        if not self.language.moe_norm_topk_prob:
            raise ConfigError(
                "model.language.moe_norm_topk_prob=false: Qwen3-VL-MoE's router always "
                "renormalises the top-k probabilities",
                fix="set it to true",
            )


def read_hf_config(source: str | Path | dict[str, Any]) -> Qwen3VLMoeConfig:
    """The config of a Qwen3-VL-MoE ``config.json`` (a directory or the parsed dict)."""
    hf, where = read_config_json(source, "Hugging Face Qwen3-VL-MoE")
    check_model_type(
        hf, where, HF_MODEL_TYPE, fix="point at a Qwen3VLMoeForConditionalGeneration checkpoint"
    )
    # transformers' Qwen3-VL-MoE router has no switch: it always renormalises the top-k
    return config_from_hf(
        hf, where, Qwen3VLMoeConfig, name="Qwen3-VL-MoE", text_overrides={"norm_topk_prob": True}
    )


def to_hf_config(cfg: Qwen3VLMoeConfig) -> Any:
    """``transformers.Qwen3VLMoeConfig`` for ``cfg``."""
    from transformers import Qwen3VLMoeConfig as HFConfig

    lang = cfg.language
    text = hf_text_config(cfg)
    text.update(
        num_experts=lang.num_experts,
        num_experts_per_tok=lang.moe_topk,
        moe_intermediate_size=lang.moe_ffn_hidden_size,
        router_aux_loss_coef=lang.moe_aux_loss_coeff,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return HFConfig(
        text_config=text,
        **hf_outer_fields(cfg),
        architectures=["Qwen3VLMoeForConditionalGeneration"],
    )


def compose(
    base: Qwen3VLMoeConfig,
    *,
    language: Mapping[str, Any] | None = None,
    vision: Mapping[str, Any] | None = None,
) -> Qwen3VLMoeConfig:
    """``base`` with a run's ``model.language`` (a decoder flavor and field overrides, e.g.
    ``model/llm@model.language=qwen3_moe_30b_a3b``) and ``model.vision`` (``flavor`` and
    field overrides) laid over it, validated. The mergers' width follows the decoder; a
    decoder without ``mrope_section`` keeps ``base``'s (its head width must fit it)."""
    section = dict(language or {})
    lang = language_from_section(section, base.language)
    if section.get("mrope_section") is None:
        lang = dataclasses.replace(lang, mrope_section=base.language.mrope_section)
    raw = dict(vision or {})
    tower = vision_flavor(raw.pop("flavor")) if "flavor" in raw else base.vision
    names = {f.name for f in dataclasses.fields(Qwen3VisionConfig)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(
            f"{', '.join(f'model.vision.{k}' for k in unknown)}: unknown key(s)",
            fix=f"the Qwen3-VL tower takes {sorted(names)}",
        )
    if "deepstack_visual_indexes" in raw:
        raw["deepstack_visual_indexes"] = tuple(raw["deepstack_visual_indexes"])
    tower = tower.replace(**{"out_hidden_size": lang.hidden_size, **raw})
    cfg = dataclasses.replace(base, language=lang, vision=tower)
    cfg.validate()
    return cfg


def from_model_config(model: Any) -> Qwen3VLMoeConfig:
    """The config of a run's ``model`` section: flavor ``model.flavor`` with the
    ``model.language`` / ``model.vision`` sections laid over it (``compose``)."""
    if getattr(model, "projector", None):
        raise ConfigError(
            "Qwen3-VL-MoE's projector is the tower's merger",
            key="model.projector",
            fix="drop model.projector (set merger widths under model.vision)",
        )
    return compose(
        flavor(model.flavor), language=dict(model.language or {}), vision=dict(model.vision or {})
    )


def build(cfg: Qwen3VLMoeConfig, **options: Any) -> VisionLanguageModel:
    """This rank's Qwen3-VL-MoE (megatron parallel state initialised), built as the dense
    family's ``build`` with the MoE decoder; the experts are split over the expert-parallel
    ranks."""
    from longboat.vlm.models.qwen3_vl.model import build as build_qwen3_vl

    return build_qwen3_vl(cfg, **options)


@torch.no_grad()
def load_hf(model: VisionLanguageModel, cfg: Qwen3VLMoeConfig, hf_dir: str | Path) -> int:
    """Load a Qwen3-VL-MoE directory (fused experts in either orientation) into this rank's
    model after checking that its config describes ``cfg``; returns the tensors read."""
    from longboat.vlm.models.qwen3_vl import vision_hf

    check_checkpoint_architecture(cfg.architecture(), read_hf_config(hf_dir).architecture(), hf_dir)
    return load_decoder_and_tower(model, cfg, hf_dir, vision_hf, expert_layout=EXPERT_LAYOUT)


def save_hf(model: VisionLanguageModel, cfg: Qwen3VLMoeConfig, out_dir: str | Path) -> Path:
    """Write ``config.json`` + the safetensors weights ``transformers`` loads (collective
    over the world; each layer's fused experts gathered over the expert-parallel group)."""
    from longboat.vlm.models.qwen3_vl import vision_hf

    return save_decoder_and_tower(
        model, cfg, out_dir, vision_hf, to_hf_config,
        language_prefix="model.language_model.", visual_prefix="model.visual.",
        expert_layout=EXPERT_LAYOUT,
    )  # fmt: skip


def visual_hf_state(model: VisionLanguageModel, cfg: Qwen3VLMoeConfig) -> dict[str, torch.Tensor]:
    """The tower with its mergers under ``transformers``' names (``model.visual.*``)."""
    from longboat.vlm.models.qwen3_vl import vision_hf

    return tower_hf_state(model, cfg.vision, vision_hf, "model.visual.")


def _flavors() -> dict[str, Qwen3VLMoeConfig]:
    tiny_language = dataclasses.replace(
        decoder_flavor("qwen3_moe", "tiny"),
        vocab_size=384,
        mrope_section=[4, 2, 2],
        moe_aux_loss_coeff=0.001,  # transformers' router_aux_loss_coef default
    )
    # Qwen3-VL-30B-A3B: Qwen3-30B-A3B's decoder with Qwen3-VL's rotary, the 27-block tower.
    language_30b = dataclasses.replace(
        decoder_flavor("qwen3_moe", "30b_a3b"),
        flavor="vl_30b_a3b",
        max_position_embeddings=262144,
        rope_theta=5000000.0,
        mrope_section=list(QWEN3_VL_MROPE),
    )
    return {
        "tiny": Qwen3VLMoeConfig(
            language=tiny_language,
            vision=vision_flavor("tiny").replace(out_hidden_size=tiny_language.hidden_size),
            image_token_id=310,
            video_token_id=311,
            vision_start_token_id=312,
            vision_end_token_id=313,
        ),
        "30b_a3b": Qwen3VLMoeConfig(
            language=language_30b,
            vision=vision_flavor("8b").replace(out_hidden_size=language_30b.hidden_size),
        ),
    }


FLAVORS = ("tiny", "30b_a3b")


def flavor(name: str) -> Qwen3VLMoeConfig:
    """Qwen3-VL-MoE flavor ``name``: ``tiny`` (CPU tests), ``30b_a3b`` (as released)."""
    return pick_flavor(_flavors(), name, "Qwen3-VL-MoE")

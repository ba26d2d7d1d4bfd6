"""GR00T N1.6 as longboat-embodied sees it: its ``PolicyFamily`` (core's family registry
finds ``FAMILY``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from longboat.core.config.errors import ConfigError
from longboat.embodied.models.family import (
    BackboneAdapter,
    CheckpointAdapter,
    ExportFormat,
    PolicyBatchSpec,
    PolicyFamily,
    PromptProcessor,
    flavors_of,
)
from longboat.embodied.models.groot_n1_6 import (
    hf_backbone,
    isaac_export,
    isaac_format,
    lerobot_format,
    processor,
)
from longboat.embodied.models.groot_n1_6.config import GrootN16Config
from longboat.embodied.models.groot_n1_6.flops import flops_per_sample
from longboat.embodied.models.groot_n1_6.isaac_processor import checkpoint_stats, embodiment_tags
from longboat.embodied.models.groot_n1_6.model import GrootN16
from longboat.embodied.models.registry import apply_overrides


def batch_spec(
    cfg: GrootN16Config,
    num_cameras: int,
    image_hw: tuple[int, int],
    *,
    resize_cameras: bool = False,
) -> PolicyBatchSpec:
    """GR00T's batches: the cameras as read with an ``embodiment_id`` per sample, text within
    what ``max_seq_len`` leaves after the image tokens, ids below the image token."""
    image_tokens = num_cameras * cfg.tokens_per_image(*image_hw)
    text = max(4, min(32, cfg.max_seq_len - image_tokens))
    return PolicyBatchSpec(
        max_state_dim=cfg.max_state_dim,
        action_dim=cfg.max_action_dim,
        horizon=cfg.action_horizon,
        max_text_tokens=text,
        vocab_limit=min(cfg.llm.vocab_size, cfg.image_token_id),
        num_cameras=None,
        with_embodiment=True,
        with_image_mask=False,
        image_size=tuple(cfg.input_image_size()),
        pad_to_size=False,
        resize_cameras=resize_cameras,
    )


def checkpoint_kind(init_from: str) -> str:
    """``isaac`` (an Isaac-GR00T N1.6 directory) or ``lerobot`` (a LeRobot groot policy),
    from its config.json."""
    raw = isaac_format.read_json_config(init_from)
    if raw.get("model_type") == isaac_format.MODEL_TYPE:
        return "isaac"
    if raw.get("type") == lerobot_format.POLICY_TYPE:
        return "lerobot"
    raise ConfigError(
        f"{Path(init_from) / 'config.json'} is neither an Isaac-GR00T N1.6 checkpoint "
        f"(model_type={raw.get('model_type')!r}) nor a LeRobot groot policy "
        f"(type={raw.get('type')!r})",
        key="model.init_from",
        fix=f'use a directory whose config.json has "model_type": "{isaac_format.MODEL_TYPE}"',
    )


def _meta_model(cfg: GrootN16Config) -> GrootN16:
    with torch.device("meta"):
        return GrootN16(cfg)


def resolve_isaac_config(overrides: Mapping[str, Any], init_from: str) -> GrootN16Config:
    """An Isaac-GR00T N1.6 directory's architecture + ``overrides``, its weights' names and
    shapes checked; a LeRobot groot directory (GR00T N1.7) is refused with the keys that do
    not fit."""
    if checkpoint_kind(init_from) == "lerobot":
        _, base = lerobot_format.read_lerobot_groot(init_from)
        cfg = apply_overrides(lerobot_format.config_from_lerobot_groot(base), overrides)
        lerobot_format.refuse_for_init_from(_meta_model(cfg), init_from)
        return cfg  # not reached: refuse_for_init_from always raises
    raw = isaac_format.read_isaac_config(init_from)
    cfg = apply_overrides(isaac_format.config_from_isaac(raw), overrides)
    isaac_format.check_isaac_weights(_meta_model(cfg), init_from)
    return cfg


def checkpoint_statistics(
    directory: str, names: list[str], index: int, widths: dict[str, int]
) -> Mapping[str, Any] | None:
    """The Isaac checkpoint's ``statistics.json`` entry of sub-dataset ``index`` (its
    embodiment tag: ``new_embodiment`` for one dataset, else its folder name)."""
    return checkpoint_stats(directory, embodiment_tags(names)[index], widths)


FAMILY = PolicyFamily(
    name="groot_n1_6",
    schema=GrootN16Config,
    flavors=flavors_of(GrootN16Config),
    build=GrootN16,
    batch_spec=batch_spec,
    action_width_key="max_action_dim",
    synthetic_image_hw=(56, 84),
    prompts=PromptProcessor(
        find_tokenizer=processor.find_tokenizer,
        needs_tokenizer=processor.needs_tokenizer,
        missing_tokenizer_error=processor.missing_tokenizer_error,
        build=processor.GrootPromptTokenizer,
        # Isaac-GR00T's inputs: the image placeholders are in the prompt.
        config_overrides={"image_tokens_in_text": True},
        hint="set model.tokenizer=<dir> (nvidia/Eagle-Block2A-2B-v2's tokenizer) for "
        "Isaac-GR00T's prompt",
        copy=processor.copy_tokenizer,
    ),
    checkpoints=CheckpointAdapter(
        description="Isaac-GR00T N1.6 directories (e.g. nvidia/GR00T-N1.6-3B)",
        resolve_config=resolve_isaac_config,
        load_weights=isaac_format.load_isaac_weights,
        statistics=checkpoint_statistics,
    ),
    backbones=BackboneAdapter(
        kinds=hf_backbone.KINDS,
        backbone_state=hf_backbone.backbone_state,
        initialised_parts=hf_backbone.initialised_parts,
    ),
    export_formats=(
        ExportFormat(
            name="isaac",
            label="Isaac-GR00T N1.6",
            loaded_by="model.init_from",
            write=isaac_export.write_run_export,
            convert=isaac_export.convert,
        ),
    ),
    flops_per_sample=flops_per_sample,
    # The Eagle LM's attention and MLP, and the DiT action head's attention and feed-forward.
    lora_targets=(
        *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        *("to_q", "to_k", "to_v", "to_out", "ff_in", "ff_out"),
    ),
)

"""pi0.5 as longboat-embodied sees it: its ``PolicyFamily`` (core's family registry finds ``FAMILY``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from longboat.embodied.models.common.lerobot_checkpoint import check_lerobot_weights
from longboat.embodied.models.family import (
    BackboneAdapter,
    CheckpointAdapter,
    ExportFormat,
    PolicyBatchSpec,
    PolicyFamily,
    PromptProcessor,
    flavors_of,
)
from longboat.embodied.models.pi05 import hf_backbone, lerobot_export, processor
from longboat.embodied.models.pi05.config import Pi05Config
from longboat.embodied.models.pi05.flops import flops_per_sample
from longboat.embodied.models.pi05.lerobot_format import (
    config_from_lerobot,
    from_lerobot_state_dict,
    load_lerobot_weights,
    read_lerobot_config,
)
from longboat.embodied.models.pi05.model import Pi05
from longboat.embodied.models.pi05.stand_in_tokenizer import write_stand_in_tokenizer
from longboat.embodied.models.registry import apply_overrides


def batch_spec(
    cfg: Pi05Config,
    num_cameras: int,
    image_hw: tuple[int, int],
    *,
    resize_cameras: bool = False,
) -> PolicyBatchSpec:
    """pi0.5's batches: ``cfg.num_cameras`` camera slots with an ``image_mask``, frames
    padded to its square image size, text and discrete state tokens within
    ``max_token_len``."""
    text = max(4, min(32, cfg.max_token_len - cfg.max_state_dim))
    return PolicyBatchSpec(
        max_state_dim=cfg.max_state_dim,
        action_dim=cfg.action_dim,
        horizon=cfg.action_horizon,
        max_text_tokens=text,
        vocab_limit=cfg.llm.vocab_size,
        num_cameras=getattr(cfg, "num_cameras", None),
        with_embodiment=False,
        with_image_mask=True,
        image_size=tuple(cfg.input_image_size()),
        pad_to_size=True,
        resize_cameras=resize_cameras,
    )


def resolve_lerobot_config(overrides: Mapping[str, Any], init_from: str) -> Pi05Config:
    """A LeRobot pi0.5 policy's architecture + ``overrides``; its weights' names and shapes
    checked (a CheckpointError listing every mismatch)."""
    cfg = apply_overrides(config_from_lerobot(read_lerobot_config(init_from)), overrides)
    check_lerobot_weights(init_from, Pi05, cfg, from_lerobot_state_dict)
    return cfg


FAMILY = PolicyFamily(
    name="pi05",
    schema=Pi05Config,
    flavors=flavors_of(Pi05Config),
    build=Pi05,
    batch_spec=batch_spec,
    action_width_key="action_dim",
    synthetic_image_hw=(56, 56),
    prompts=PromptProcessor(
        find_tokenizer=processor.find_tokenizer,
        needs_tokenizer=processor.needs_tokenizer,
        missing_tokenizer_error=processor.missing_tokenizer_error,
        build=processor.build_prompt_tokenizer,
        # LeRobot's pi0.5 inputs: the state spelled in the prompt, frames not cropped inside
        # the policy (LeRobot's are not).
        config_overrides={"state_in_prompt": True, "image.crop_fraction": 1.0},
        hint="set model.tokenizer=<dir> for LeRobot's pi0.5 prompt",
        copy=processor.copy_tokenizer,
        stand_in=lambda directory, cfg: write_stand_in_tokenizer(directory, cfg.llm.vocab_size),
    ),
    checkpoints=CheckpointAdapter(
        description="LeRobot pi0.5 policies (e.g. lerobot/pi05_base)",
        resolve_config=resolve_lerobot_config,
        load_weights=load_lerobot_weights,
    ),
    backbones=BackboneAdapter(
        kinds=hf_backbone.KINDS,
        backbone_state=hf_backbone.backbone_state,
        initialised_parts=hf_backbone.initialised_parts,
    ),
    export_formats=(
        ExportFormat(
            name="lerobot",
            label="LeRobot pi0.5",
            loaded_by="model.init_from, PI05Policy.from_pretrained",
            write=lerobot_export.write_run_export,
            convert=lerobot_export.convert,
            unavailable=lerobot_export.unavailable,
        ),
    ),
    flops_per_sample=flops_per_sample,
    # The attention and MLP of the joint PaliGemma / action-expert layers, and the action and
    # time projections.
    lora_targets=(
        *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        *("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"),
    ),
)

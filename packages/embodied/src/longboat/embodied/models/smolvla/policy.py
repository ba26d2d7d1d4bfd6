"""SmolVLA as longboat-embodied sees it: its ``PolicyFamily`` (core's family registry finds
``FAMILY``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from longboat.embodied.models.common.lerobot_checkpoint import check_lerobot_weights
from longboat.embodied.models.family import (
    CheckpointAdapter,
    ExportFormat,
    PolicyBatchSpec,
    PolicyFamily,
    PromptProcessor,
    flavors_of,
)
from longboat.embodied.models.registry import apply_overrides
from longboat.embodied.models.smolvla import lerobot_export, processor
from longboat.embodied.models.smolvla.config import SmolVLAConfig
from longboat.embodied.models.smolvla.lerobot_format import (
    config_from_lerobot,
    from_lerobot_state_dict,
    load_lerobot_weights,
    read_lerobot_config,
)
from longboat.embodied.models.smolvla.model import SmolVLA


def batch_spec(
    cfg: SmolVLAConfig,
    num_cameras: int,
    image_hw: tuple[int, int],
    *,
    resize_cameras: bool = False,
) -> PolicyBatchSpec:
    """SmolVLA's batches: ``cfg.num_cameras`` camera slots with an ``image_mask``, the
    prompt within ``max_token_len``, the state as one vector (no state tokens)."""
    return PolicyBatchSpec(
        max_state_dim=cfg.max_state_dim,
        action_dim=cfg.action_dim,
        horizon=cfg.action_horizon,
        max_text_tokens=cfg.max_token_len,
        vocab_limit=cfg.text.vocab_size,
        num_cameras=cfg.num_cameras,
        with_embodiment=False,
        with_image_mask=True,
        image_size=tuple(cfg.input_image_size()),
        pad_to_size=False,
        resize_cameras=resize_cameras,
    )


def flops_per_sample(
    cfg: SmolVLAConfig, num_cameras: int, image_hw: tuple[int, int], text_len: int
) -> float:
    """Useful training FLOPs of one sample: 6 x parameters x tokens for the parts that train,
    2 x for the frozen ones (forward only), per stream (vision patches, prefix, suffix)."""
    v, t, e = cfg.vision, cfg.text, cfg.expert
    patches = num_cameras * v.pos_grid[0] * v.pos_grid[1]
    vit = v.num_layers * (4 * v.hidden_size**2 + 2 * v.hidden_size * v.intermediate_size)
    prefix = num_cameras * cfg.image_tokens() + text_len + 1
    lm = t.num_layers * (
        t.hidden_size * (t.num_heads + 2 * t.num_kv_heads) * t.head_dim * 2
        + 3 * t.hidden_size * t.intermediate_size
    )
    ex = e.num_layers * (
        e.hidden_size * e.num_heads * e.head_dim * 2 + 3 * e.hidden_size * e.intermediate_size
    )
    vit_mult = 6 if cfg.tune_visual else 2
    lm_mult = 6 if cfg.tune_llm else 2
    return float(
        vit_mult * vit * patches
        + lm_mult * lm * prefix
        + (6 if cfg.tune_action_head else 2) * ex * cfg.action_horizon
    )


def resolve_lerobot_config(overrides: Mapping[str, Any], init_from: str) -> SmolVLAConfig:
    """A LeRobot SmolVLA policy's architecture + ``overrides``; its weights' names and shapes
    checked (a CheckpointError listing every mismatch)."""
    cfg = apply_overrides(config_from_lerobot(read_lerobot_config(init_from)), overrides)
    check_lerobot_weights(init_from, SmolVLA, cfg, from_lerobot_state_dict)
    return cfg


FAMILY = PolicyFamily(
    name="smolvla",
    schema=SmolVLAConfig,
    flavors=flavors_of(SmolVLAConfig),
    build=SmolVLA,
    batch_spec=batch_spec,
    action_width_key="action_dim",
    synthetic_image_hw=(32, 32),
    prompts=PromptProcessor(
        find_tokenizer=processor.find_tokenizer,
        needs_tokenizer=processor.needs_tokenizer,
        missing_tokenizer_error=processor.missing_tokenizer_error,
        build=processor.build_prompt_tokenizer,
        config_overrides={"backbone_prompts": True},
        hint="set model.tokenizer=<dir> for the backbone's tokenizer (SmolVLM2's)",
    ),
    checkpoints=CheckpointAdapter(
        description="LeRobot SmolVLA policies (e.g. lerobot/smolvla_base)",
        resolve_config=resolve_lerobot_config,
        load_weights=load_lerobot_weights,
    ),
    export_formats=(
        ExportFormat(
            name="lerobot",
            label="LeRobot SmolVLA",
            loaded_by="model.init_from, SmolVLAPolicy.from_pretrained",
            write=lerobot_export.write_run_export,
            convert=lerobot_export.convert,
            unavailable=lerobot_export.unavailable,
        ),
    ),
    flops_per_sample=flops_per_sample,
    # The attention and MLP of the joint SmolVLM2-text / action-expert layers, and the state,
    # action and action-time projections; the vision encoder and its connector stay frozen.
    lora_targets=(
        *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        *("state_proj", "action_in_proj", "action_out_proj"),
        *("action_time_mlp_in", "action_time_mlp_out"),
    ),
)

"""LeRobot's SmolVLA processor files, so ``make_pre_post_processors(cfg,
pretrained_path=dir)`` (LeRobot's evaluation tools) normalise observations and unnormalise
actions with the statistics the policy was trained on.

Written as LeRobot writes them: ``policy_preprocessor.json`` (rename, batch, the task's
trailing newline, the backbone's tokenizer named by ``vlm_model_name``, device, normaliser)
and ``policy_postprocessor.json`` (unnormaliser, device), each normaliser's statistics in
``policy_{pre,post}processor_step_<i>_<name>.safetensors`` as ``<feature>.<stat>`` float32
tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from longboat.embodied.models.common.lerobot_checkpoint import write_processor_files
from longboat.embodied.models.common.lerobot_stats import stats_tensors

PRE_STATE = "policy_preprocessor_step_5_normalizer_processor.safetensors"
POST_STATE = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"


def save_lerobot_processors(
    directory: str | Path,
    lerobot_cfg: Mapping[str, Any],
    stats: Mapping[str, Mapping[str, Any]],
    *,
    device: str = "cpu",
) -> list[Path]:
    """Write LeRobot's pre/post-processor files for a SmolVLA ``lerobot_cfg`` (the dict
    ``lerobot_config_for`` returns) with ``stats`` ({feature: {mean, std, min, max, ...}};
    each feature needs the two its ``normalization_mapping`` mode reads). Returns the files
    written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    inputs = dict(lerobot_cfg["input_features"])
    outputs = dict(lerobot_cfg["output_features"])
    norm_map = dict(lerobot_cfg.get("normalization_mapping") or {})
    tensors = stats_tensors(stats, {**inputs, **outputs}, norm_map)
    device_step = {
        "registry_name": "device_processor",
        "config": {"device": device, "float_dtype": None},
    }
    pre = {
        "name": "policy_preprocessor",
        "steps": [
            {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}},
            {"registry_name": "smolvla_new_line_processor", "config": {}},
            {
                "registry_name": "tokenizer_processor",
                "config": {
                    "max_length": int(lerobot_cfg["tokenizer_max_length"]),
                    "task_key": "task",
                    "padding_side": "right",
                    "padding": str(lerobot_cfg.get("pad_language_to", "longest")),
                    "truncation": True,
                    "tokenizer_name": str(lerobot_cfg["vlm_model_name"]),
                },
            },
            device_step,
            {
                "registry_name": "normalizer_processor",
                "config": {"eps": 1e-8, "features": {**inputs, **outputs}, "norm_map": norm_map},
                "state_file": PRE_STATE,
            },
        ],
    }
    post = {
        "name": "policy_postprocessor",
        "steps": [
            {
                "registry_name": "unnormalizer_processor",
                "config": {"eps": 1e-8, "features": outputs, "norm_map": norm_map},
                "state_file": POST_STATE,
            },
            device_step,
        ],
    }
    return write_processor_files(directory, pre, post, tensors, (PRE_STATE, POST_STATE))

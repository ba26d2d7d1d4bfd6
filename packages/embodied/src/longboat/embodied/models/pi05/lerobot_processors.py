"""LeRobot's pi0.5 processor files, so ``make_pre_post_processors(cfg, pretrained_path=dir)``
(LeRobot's evaluation tools) normalise observations and unnormalise actions with the
statistics the policy was trained on.

Written: ``policy_preprocessor.json`` (rename, batch, relative-actions off, normaliser,
pi0.5's state-into-prompt step, the PaliGemma tokenizer, device) and
``policy_postprocessor.json`` (unnormaliser, absolute-actions off, device), each
normaliser's statistics in ``policy_{pre,post}processor_step_<i>_<name>.safetensors`` as
``<feature>.<stat>`` float32 tensors. Given the run's tokenizer directory, its files are
copied into ``tokenizer/`` and the tokenizer step names that folder by the relative path
``tokenizer``, so the directory can be moved: ``model.init_from`` and longboat's
``load_policy`` resolve it against the directory. LeRobot passes ``tokenizer_name`` to
``AutoTokenizer.from_pretrained`` as it is (relative to the working directory): load the
processors from inside the directory, or with ``overrides=preprocessor_overrides(dir)``.
Without a tokenizer the step names ``google/paligemma-3b-pt-224``, which LeRobot fetches from
the Hub.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from longboat.embodied.models.common.lerobot_checkpoint import write_processor_files
from longboat.embodied.models.common.lerobot_stats import stats_tensors
from longboat.embodied.models.pi05.processor import (
    PALIGEMMA_TOKENIZER,
    TOKENIZER_DIR,
    copy_tokenizer,
)

TOKENIZER = PALIGEMMA_TOKENIZER


def save_lerobot_processors(
    directory: str | Path,
    lerobot_cfg: Mapping[str, Any],
    stats: Mapping[str, Mapping[str, Any]],
    *,
    device: str = "cpu",
    tokenizer: str | Path | None = None,
) -> list[Path]:
    """Write LeRobot's pre/post-processor files for a pi0.5 ``lerobot_cfg`` (the dict that
    ``lerobot_config_for`` returns) with ``stats`` ({feature: {mean, std, min, max, q01,
    q99}}, e.g. a dataset's ``meta/stats.json``; each feature needs the two its
    ``normalization_mapping`` mode reads, the others are kept when given) and ``tokenizer``
    (a tokenizer directory copied into ``tokenizer/``; None: PaliGemma's Hub name). Returns
    the files written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_name = TOKENIZER
    if tokenizer is not None:
        copy_tokenizer(tokenizer, directory / TOKENIZER_DIR)
        tokenizer_name = TOKENIZER_DIR  # relative: the directory stays movable
    inputs = dict(lerobot_cfg["input_features"])
    outputs = dict(lerobot_cfg["output_features"])
    norm_map = dict(lerobot_cfg.get("normalization_mapping") or {})
    tensors = stats_tensors(stats, {**inputs, **outputs}, norm_map)
    device_step = {
        "registry_name": "device_processor",
        "config": {"device": device, "float_dtype": None},
    }
    pre_state = "policy_preprocessor_step_3_normalizer_processor.safetensors"
    post_state = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
    pre = {
        "name": "policy_preprocessor",
        "steps": [
            {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}},
            {
                "registry_name": "relative_actions_processor",
                "config": {"enabled": False, "exclude_joints": ["gripper"], "action_names": None},
            },
            {
                "registry_name": "normalizer_processor",
                "config": {"eps": 1e-8, "features": {**inputs, **outputs}, "norm_map": norm_map},
                "state_file": pre_state,
            },
            {
                "registry_name": "pi05_prepare_state_tokenizer_processor_step",
                "config": {"max_state_dim": int(lerobot_cfg["max_state_dim"])},
            },
            {
                "registry_name": "tokenizer_processor",
                "config": {
                    "max_length": int(lerobot_cfg["tokenizer_max_length"]),
                    "task_key": "task",
                    "padding_side": "right",
                    "padding": "max_length",
                    "truncation": True,
                    "tokenizer_name": tokenizer_name,
                },
            },
            device_step,
        ],
    }
    post = {
        "name": "policy_postprocessor",
        "steps": [
            {
                "registry_name": "unnormalizer_processor",
                "config": {"eps": 1e-8, "features": outputs, "norm_map": norm_map},
                "state_file": post_state,
            },
            {"registry_name": "absolute_actions_processor", "config": {"enabled": False}},
            device_step,
        ],
    }
    return write_processor_files(directory, pre, post, tensors, (pre_state, post_state))


def preprocessor_overrides(directory: str | Path) -> dict[str, dict[str, str]]:
    """``overrides`` for LeRobot's ``PolicyProcessorPipeline.from_pretrained(directory,
    ...)`` from any working directory: the tokenizer step's relative ``tokenizer_name``
    resolved against ``directory`` (empty when it names a Hub tokenizer)."""
    path = Path(directory) / "policy_preprocessor.json"
    for step in json.loads(path.read_text()).get("steps", []):
        name = (step.get("config") or {}).get("tokenizer_name")
        if step.get("registry_name") == "tokenizer_processor" and name:
            local = Path(directory) / name
            if not Path(name).is_absolute() and local.is_dir():
                return {"tokenizer_processor": {"tokenizer_name": str(local.resolve())}}
    return {}

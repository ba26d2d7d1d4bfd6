"""LeRobot's ``groot`` policy format (lerobot 0.6.1), as far as it is GR00T N1.6's.

LeRobot 0.6.1's ``groot`` policy is GR00T **N1.7** (N1.5 support was removed from LeRobot in
that release). A policy directory holds ``config.json`` (LeRobot's ``GrootConfig``,
``"type": "groot"``) and ``model.safetensors`` with ``_groot_model.backbone.model.*`` (a
Qwen3-VL / Cosmos-Reason2 backbone) and ``_groot_model.action_head.*``. The architecture is
not in that config.json: it is the ``GR00TN17Config`` in the ``config.json`` of the
policy's ``base_model_path`` (a local directory here; ``nvidia/GR00T-N1.7-3B`` on the Hub).

What N1.7 and our N1.6 share is the action head: vlln, the per-embodiment state encoder,
action encoder and decoder, the position embedding and the 32-block alternating
self / cross-attention DiT with AdaLN, with the same module names as Isaac-GR00T's N1.6, and
the flow-matching loss and Euler sampling. What differs:

- the backbone: N1.7's Qwen3-VL (its own ViT with 16-px patches, temporal patches and
  multimodal RoPE) against N1.6's Eagle (SigLIP2 tower, 2x2 pixel-unshuffle ``mlp1``,
  Qwen3). Its weights cannot be loaded into ours, nor ours written as it;
- N1.7's optional ``vl_self_attention`` transformer after vlln (read only with 0 layers);
- state dropout: N1.7 zeroes the dropped state token, N1.6 swaps in a learned mask token
  (loading sets our mask token to zero, which is N1.7's rule; it is not written back);
- the processors: Qwen3-VL's chat template and image processor against Eagle's.

So ``model.init_from`` refuses a LeRobot groot directory (naming the backbone keys and
pointing at the Isaac-GR00T N1.6 layout), and this module reads and writes the action head:
``load_lerobot_action_head`` and ``save_lerobot_groot``, which writes our action head into a
LeRobot policy directory around the N1.7 backbone of the LeRobot checkpoint it came from,
with LeRobot's processor files and our normaliser statistics.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from longboat.core.config.errors import ConfigError
from longboat.embodied.models.groot_n1_6.config import GrootN16Config
from longboat.embodied.models.groot_n1_6.isaac_format import (
    CONFIG_NAME,
    EAGLE_VARIANTS,
    WEIGHTS_NAME,
    config_from_isaac,
    read_json_config,
    read_shapes,
    read_tensors,
)
from longboat.embodied.models.groot_n1_6.weight_names import (
    action_head_names,
    mismatch_report,
    raise_on_mismatch,
)

POLICY_TYPE = "groot"
BASE_MODEL_TYPE = "Gr00tN1d7"
ACTION_HEAD_PREFIX = "_groot_model.action_head."
BACKBONE_PREFIX = "_groot_model.backbone."
NEW_EMBODIMENT = "new_embodiment"
STATE_KEY, ACTION_KEY = "observation.state", "action"


def read_lerobot_groot(directory: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(policy config.json, base model config.json) of a LeRobot groot policy directory."""
    policy = read_json_config(directory)
    if policy.get("type") != POLICY_TYPE:
        raise ConfigError(
            f"{Path(directory) / CONFIG_NAME} is a {policy.get('type')!r} policy, not 'groot'",
            key="model.init_from",
        )
    base_path = policy.get("base_model_path")
    if not base_path or not (Path(base_path) / CONFIG_NAME).is_file():
        raise ConfigError(
            f"the groot policy's base_model_path={base_path!r} is not a local directory with a "
            "config.json; LeRobot keeps the architecture there",
            key="model.init_from",
            fix="download the base model (e.g. nvidia/GR00T-N1.7-3B) and set base_model_path "
            "in the policy's config.json to that directory",
        )
    base = read_json_config(base_path)
    if base.get("model_type") != BASE_MODEL_TYPE:
        raise ConfigError(
            f"{Path(base_path) / CONFIG_NAME} has model_type={base.get('model_type')!r}, not "
            f"{BASE_MODEL_TYPE!r}",
            key="model.init_from",
        )
    return policy, base


def config_from_lerobot_groot(base: dict[str, Any]) -> GrootN16Config:
    """Our config for the action head a ``GR00TN17Config`` dict describes; the backbone is
    the Eagle variant of the same width (only the action head is ever loaded from it)."""
    problems = []
    vl_sa = base.get("vl_self_attention_cfg") or {}
    if int(vl_sa.get("num_layers", 0) or 0) > 0:
        problems.append(
            f"vl_self_attention_cfg.num_layers={vl_sa['num_layers']}: N1.6 has no "
            "vl_self_attention (only 0 layers)"
        )
    if int(base.get("state_history_length", 1)) != 1:
        problems.append("state_history_length must be 1")
    width = int(base.get("backbone_embedding_dim", 2048))
    variant = next((n for n, f in EAGLE_VARIANTS.items() if f().llm.hidden_size == width), None)
    if variant is None:
        problems.append(f"backbone_embedding_dim={width} matches no Eagle width we build")
    if problems:
        raise ConfigError(
            "the LeRobot GR00T N1.7 action head cannot be built: " + "; ".join(problems),
            key="model.init_from",
        )
    raw = {**base, "model_name": variant, "model_type": "Gr00tN1d6"}
    for key in ("image_crop_size", "image_target_size"):  # the N1.7 processor's, not ours
        raw.pop(key, None)
    return config_from_isaac(raw)


def action_head_fields(cfg: GrootN16Config) -> dict[str, Any]:
    """The config fields that shape the action head (what two configs must share for one
    action head to load into the other)."""
    keys = [
        "num_embodiments",
        "max_state_dim",
        "max_action_dim",
        "action_horizon",
        "state_hidden",
        "action_decoder_hidden",
        "max_seq_len",
        "num_timestep_buckets",
    ]
    out = {k: getattr(cfg, k) for k in keys}
    out["dit"] = dataclasses.replace(cfg.dit, dropout=0.0)
    out["llm_width"] = cfg.llm.hidden_size
    return out


def _names(cfg: GrootN16Config) -> dict[str, str]:
    names = action_head_names(cfg, ACTION_HEAD_PREFIX)
    names.pop("action_head.mask_token", None)  # N1.7 has none
    return names


def from_lerobot_action_head(
    model: torch.nn.Module, state: dict[str, Tensor], *, source: str = "checkpoint"
) -> dict[str, Tensor]:
    """LeRobot-named ``state`` -> our ``action_head.*`` tensors (names and shapes checked;
    the backbone's keys are not read)."""
    cfg: GrootN16Config = model.cfg
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names = _names(cfg)
    want = {theirs: ours[k] for k, theirs in names.items()}
    head = {k: v for k, v in state.items() if k.startswith(ACTION_HEAD_PREFIX)}
    raise_on_mismatch(
        source,
        "the groot_n1_6 action head its base model's config.json describes",
        mismatch_report(want, head),
        "use the base model (base_model_path) these weights were saved with",
    )
    out = {k: state[theirs] for k, theirs in names.items()}
    if "action_head.mask_token" in ours:
        out["action_head.mask_token"] = torch.zeros(ours["action_head.mask_token"])
    return out


def to_lerobot_action_head(model: torch.nn.Module) -> dict[str, Tensor]:
    """Our action head under LeRobot's names (fp32 contiguous copies)."""
    ours = model.state_dict()
    return {
        theirs: ours[k].detach().to(torch.float32).contiguous().clone()
        for k, theirs in _names(model.cfg).items()
    }


def refuse_for_init_from(model: torch.nn.Module, directory: str | Path) -> None:
    """``model.init_from`` with a LeRobot groot directory: one CheckpointError naming the
    N1.7 backbone keys (after any action-head mismatch)."""
    shapes = read_shapes(directory)
    source = str(Path(directory) / WEIGHTS_NAME)
    from_lerobot_action_head(model, shapes, source=source)
    backbone = sorted(k for k in shapes if not k.startswith(ACTION_HEAD_PREFIX))
    raise_on_mismatch(
        source,
        "groot_n1_6: it is LeRobot 0.6.1's GR00T N1.7",
        ([], backbone, []),
        "start from the Isaac-GR00T N1.6 release layout (config.json with model_type "
        "Gr00tN1d6), or load only the action head with "
        "longboat.embodied.models.groot_n1_6.lerobot_format.load_lerobot_action_head",
        note=f"its backbone is Qwen3-VL (under {BACKBONE_PREFIX}), which groot_n1_6's Eagle "
        f"backbone (SigLIP2 + Qwen3) cannot hold; its {len(_names(model.cfg))} action-head "
        "tensors fit",
    )


def load_lerobot_action_head(model: torch.nn.Module, directory: str | Path) -> None:
    """Copy the action head of a LeRobot groot policy into ``model`` (ours; its config's
    action head must be the one ``config_from_lerobot_groot`` reads). The backbone is left
    as it is."""
    _, base = read_lerobot_groot(directory)
    theirs = action_head_fields(config_from_lerobot_groot(base))
    mine = action_head_fields(model.cfg)
    if theirs != mine:
        differ = sorted(k for k in mine if mine[k] != theirs[k])
        raise ConfigError(
            f"the model's action head differs from {directory}'s in {differ}",
            key="model.init_from",
        )
    state = read_tensors(directory)
    ours = from_lerobot_action_head(model, state, source=str(Path(directory) / WEIGHTS_NAME))
    result = model.load_state_dict(ours, strict=False)
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if k.startswith("action_head.")]


def save_lerobot_groot(
    model: torch.nn.Module,
    directory: str | Path,
    *,
    backbone_from: str | Path,
    state_dim: int,
    action_dim: int,
    stats: dict[str, dict[str, Any]],
    embodiment_id: int = 0,
) -> Path:
    """A LeRobot groot policy directory: our action head, the N1.7 backbone of the LeRobot
    policy ``backbone_from`` (whose ``base_model_path`` must describe our action head),
    its config.json with our feature widths, and the processor files with ``stats``
    ({"observation.state" / "action": {min, max, ...}}: LeRobot's GR00T processors map
    state and action to [-1, 1] with min / max, as longboat trains)."""
    policy, base = read_lerobot_groot(backbone_from)
    theirs = action_head_fields(config_from_lerobot_groot(base))
    mine = action_head_fields(model.cfg)
    if theirs != mine:
        differ = sorted(k for k in mine if mine[k] != theirs[k])
        raise ConfigError(f"our action head differs from {backbone_from}'s in {differ}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.contiguous()
        for k, v in read_tensors(backbone_from).items()
        if k.startswith(BACKBONE_PREFIX)
    }
    tensors.update(to_lerobot_action_head(model))
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    cfg = dict(policy)
    features = dict(cfg.get("input_features") or {})
    features[STATE_KEY] = {"type": "STATE", "shape": [state_dim]}
    cfg.update(
        input_features=features,
        output_features={ACTION_KEY: {"type": "ACTION", "shape": [action_dim]}},
        chunk_size=model.cfg.action_horizon,
        n_action_steps=min(
            int(cfg.get("n_action_steps", model.cfg.action_horizon)), model.cfg.action_horizon
        ),
        max_state_dim=model.cfg.max_state_dim,
        max_action_dim=model.cfg.max_action_dim,
        embodiment_tag=NEW_EMBODIMENT,
    )
    (directory / CONFIG_NAME).write_text(json.dumps(cfg, indent=4) + "\n")
    save_lerobot_groot_processors(directory, cfg, stats, embodiment_id=embodiment_id)
    return directory


def _stats_tensors(stats: dict[str, dict[str, Any]], widths: dict[str, int]) -> dict[str, Tensor]:
    out, problems = {}, []
    for key, width in widths.items():
        if key not in stats or not {"min", "max"} <= set(stats[key]):
            problems.append(f"{key!r} needs min and max")
            continue
        for stat in ("min", "max", "mean", "std", "q01", "q99"):
            if stat not in stats[key]:
                continue
            t = torch.as_tensor(stats[key][stat], dtype=torch.float32).flatten()
            if t.numel() != width:
                problems.append(f"{key}.{stat} has {t.numel()} values, the feature {width}")
            out[f"{key}.{stat}"] = t.contiguous()
    if problems:
        raise ConfigError("normaliser statistics do not fit the policy: " + "; ".join(problems))
    return out


def save_lerobot_groot_processors(
    directory: str | Path,
    policy_cfg: dict[str, Any],
    stats: dict[str, dict[str, Any]],
    *,
    embodiment_id: int = 0,
    device: str = "cpu",
) -> list[Path]:
    """LeRobot's GR00T N1.7 pre/post-processor files for ``policy_cfg`` with ``stats``:
    the pack step (state / action min-max to [-1, 1], clipped; padding; the embodiment id
    ``new_embodiment`` -> ``embodiment_id``), the Qwen3-VL encode step (its processor is
    fetched from the Hub when first called) and the unpack / unnormalise step."""
    directory = Path(directory)
    widths = {
        STATE_KEY: int(policy_cfg["input_features"][STATE_KEY]["shape"][0]),
        ACTION_KEY: int(policy_cfg["output_features"][ACTION_KEY]["shape"][0]),
    }
    tensors = _stats_tensors(stats, widths)
    horizon = int(policy_cfg["chunk_size"])
    pack_state = "policy_preprocessor_step_2_groot_n1_7_pack_inputs_v1.safetensors"
    unpack_state = "policy_postprocessor_step_0_groot_action_unpack_unnormalize_v2.safetensors"
    device_step = {
        "registry_name": "device_processor",
        "config": {"device": device, "float_dtype": None},
    }
    pre = {
        "name": "policy_preprocessor",
        "steps": [
            {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}},
            {
                "registry_name": "groot_n1_7_pack_inputs_v1",
                "config": {
                    "state_horizon": 1,
                    "action_horizon": horizon,
                    "valid_action_horizon": horizon,
                    "video_horizon": None,
                    "max_state_dim": int(policy_cfg["max_state_dim"]),
                    "max_action_dim": int(policy_cfg["max_action_dim"]),
                    "language_key": "task",
                    "formalize_language": True,
                    "embodiment_tag": NEW_EMBODIMENT,
                    "embodiment_mapping": {NEW_EMBODIMENT: embodiment_id},
                    "normalize_min_max": True,
                    "state_dropout_prob": 0.0,
                    "clip_outliers": True,
                    "use_percentiles": False,
                    "video_modality_keys": None,
                    "raw_stats": None,
                    "modality_config": None,
                },
                "state_file": pack_state,
            },
            {
                "registry_name": "groot_n1_7_vlm_encode_v1",
                "config": {
                    "model_name": "nvidia/Cosmos-Reason2-2B",
                    "image_crop_size": [230, 230],
                    "image_target_size": [256, 256],
                    "shortest_image_edge": None,
                    "crop_fraction": None,
                    "use_albumentations": False,
                    "letter_box_transform": False,
                    "device": device,
                },
            },
            device_step,
        ],
    }
    post = {
        "name": "policy_postprocessor",
        "steps": [
            {
                "registry_name": "groot_action_unpack_unnormalize_v2",
                "config": {
                    "env_action_dim": widths[ACTION_KEY],
                    "normalize_min_max": True,
                    "clip_normalized_action": True,
                    "libero_gripper_action": False,
                    "libero_gripper_binarize": True,
                },
                "state_file": unpack_state,
            },
            {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}},
        ],
    }
    written = []
    for name, body in (("policy_preprocessor.json", pre), ("policy_postprocessor.json", post)):
        (directory / name).write_text(json.dumps(body, indent=2) + "\n")
        written.append(directory / name)
    for name in (pack_state, unpack_state):
        save_file(tensors, str(directory / name))
        written.append(directory / name)
    return written

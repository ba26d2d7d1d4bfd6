"""Reading and writing LeRobot policy directories (``config.json`` + ``model.safetensors``),
shared by the policies that speak LeRobot's format (pi0.5, SmolVLA).

Each policy keeps its own name map (ours -> LeRobot's); what is the same for all of them
lives here: reading and checking ``config.json``, camera slots, splitting the vision tower's
fused q/k/v projection into LeRobot's three, checking a file's keys before anything loads,
and writing a directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from longboat.core.checkpoint.errors import CheckpointError
from longboat.core.config.errors import ConfigError
from longboat.embodied.models.common.checkpoint_files import (
    WEIGHTS_NAME,
    mismatch_report,
    raise_on_mismatch,
    read_shapes,
)

CONFIG_NAME = "config.json"
EMPTY_CAMERA_PREFIX = "observation.images.empty_camera_"
TRAINING_NORMALIZATION = {"VISUAL": "IDENTITY", "STATE": "MIN_MAX", "ACTION": "MIN_MAX"}
"""How longboat's embodied training normalises (min_max), as LeRobot's
``normalization_mapping`` spells it."""


def read_policy_config(directory: str | Path, policy_type: str, display: str) -> dict[str, Any]:
    """``config.json`` of a LeRobot policy directory whose ``"type"`` must be
    ``policy_type`` (``display``: the policy's name in the fix); a ConfigError names the
    problem."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist",
            key="model.init_from",
            value=str(directory),
            fix="point model.init_from at a LeRobot policy directory (config.json + "
            "model.safetensors)",
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err})", key="model.init_from") from err
    if not isinstance(raw, dict) or raw.get("type") != policy_type:
        found = raw.get("type") if isinstance(raw, dict) else type(raw).__name__
        raise ConfigError(
            f"{path} is a {found!r} policy, not {policy_type!r}",
            key="model.init_from",
            fix=f'use a {display} checkpoint (config.json with "type": "{policy_type}")',
        )
    return raw


def empty_camera_key(i: int) -> str:
    """LeRobot's name of the i-th empty camera slot."""
    return f"{EMPTY_CAMERA_PREFIX}{i}"


def num_cameras(lerobot_cfg: dict[str, Any]) -> int:
    """Camera slots of the policy: its VISUAL input features and ``empty_cameras`` slots
    (LeRobot lists those as ``observation.images.empty_camera_<i>`` features once built)."""
    feats = lerobot_cfg.get("input_features") or {}
    visual = {k for k, f in feats.items() if isinstance(f, dict) and f.get("type") == "VISUAL"}
    empty = int(lerobot_cfg.get("empty_cameras", 0) or 0)
    return len(visual | {empty_camera_key(i) for i in range(empty)})


def camera_slots(camera_keys: list[str], slots: int) -> tuple[list[str], int]:
    """(VISUAL feature keys, number of empty cameras) filling a model's ``slots`` camera
    slots with ``camera_keys`` (empty-camera keys among them are dropped) and then empty
    cameras; a ConfigError when there are more cameras than slots."""
    camera_keys = [k for k in camera_keys if not k.startswith(EMPTY_CAMERA_PREFIX)]
    if len(camera_keys) > slots:
        raise ConfigError(
            f"{len(camera_keys)} cameras {camera_keys} but the model has {slots} slots",
            key="data.cameras",
        )
    n_empty = slots - len(camera_keys)
    return [*camera_keys, *(empty_camera_key(i) for i in range(n_empty))], n_empty


def split_vision_qkv(
    ours: Mapping[str, Tensor],
    out: dict[str, Tensor],
    num_layers: int,
    qkv_keys: Callable[[int], list[str]],
) -> None:
    """Write each vision block's fused ``qkv`` weight and bias into ``out`` as LeRobot's
    three projections (``qkv_keys(i)``: their names without ``.weight`` / ``.bias``)."""
    for i in range(num_layers):
        for p in ("weight", "bias"):
            parts = ours[f"vision.blocks.{i}.qkv.{p}"].chunk(3, dim=0)
            for key, part in zip(qkv_keys(i), parts, strict=True):
                out[f"{key}.{p}"] = part


def join_vision_qkv(
    state: Mapping[str, Tensor],
    out: dict[str, Tensor],
    num_layers: int,
    qkv_keys: Callable[[int], list[str]],
) -> None:
    """The inverse of ``split_vision_qkv``: LeRobot's q / k / v into our fused ``qkv``."""
    for i in range(num_layers):
        for p in ("weight", "bias"):
            parts = [state[f"{key}.{p}"] for key in qkv_keys(i)]
            out[f"vision.blocks.{i}.qkv.{p}"] = torch.cat(parts, dim=0)


def vision_qkv_shapes(
    out: dict[str, tuple[int, ...]],
    num_layers: int,
    width: int,
    qkv_keys: Callable[[int], list[str]],
) -> None:
    """Add the shapes of LeRobot's vision q / k / v projections (``width`` wide) to ``out``."""
    for i in range(num_layers):
        for key in qkv_keys(i):
            out[f"{key}.weight"], out[f"{key}.bias"] = (width, width), (width,)


def check_lerobot_state(
    want: Mapping[str, tuple[int, ...]],
    state: Mapping[str, Any],
    *,
    optional: set[str],
    source: str,
    what: str,
    fix: str,
) -> None:
    """A CheckpointError listing every missing, unexpected and mis-shaped key of ``state``
    (LeRobot's names) against ``want``; keys in ``optional`` may be there or not."""
    have = {k: v for k, v in state.items() if k not in optional}
    raise_on_mismatch(source, what, mismatch_report(want, have), fix)


def load_lerobot_weights_with(
    model: torch.nn.Module,
    directory: str | Path,
    from_lerobot_state_dict: Callable[..., dict[str, Tensor]],
) -> None:
    """Copy ``directory/model.safetensors`` (LeRobot names) into ``model`` in place through
    the policy's ``from_lerobot_state_dict``, keeping each parameter's dtype and device;
    mismatches raise before any copy."""
    path = Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist (a LeRobot policy holds model.safetensors)")
    try:
        state = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from err
    ours = from_lerobot_state_dict(model, state, source=str(path))
    result = model.load_state_dict(ours, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def check_lerobot_weights(
    init_from: str | Path,
    build: Callable[[Any], torch.nn.Module],
    cfg: Any,
    from_lerobot_state_dict: Callable[..., dict[str, Tensor]],
) -> None:
    """Check the names and shapes of ``init_from/model.safetensors`` against ``build(cfg)``
    (built on the meta device, nothing read but the file's header); a CheckpointError lists
    every mismatch."""
    path = Path(init_from) / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist (a LeRobot policy holds model.safetensors)")
    with torch.device("meta"):
        model = build(cfg)
    from_lerobot_state_dict(model, read_shapes(init_from), source=str(path))


def save_lerobot_directory(
    state: dict[str, Tensor], directory: str | Path, lerobot_cfg: dict[str, Any]
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (``state``, LeRobot's names) into
    ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / WEIGHTS_NAME))
    (directory / CONFIG_NAME).write_text(json.dumps(lerobot_cfg, indent=4) + "\n")
    return directory


def write_processor_files(
    directory: Path,
    pre: dict[str, Any],
    post: dict[str, Any],
    tensors: dict[str, Tensor],
    state_files: tuple[str, str],
) -> list[Path]:
    """Write LeRobot's ``policy_preprocessor.json`` (``pre``) and ``policy_postprocessor.json``
    (``post``) and the normaliser statistics ``tensors`` into both ``state_files`` (the
    normaliser's and the unnormaliser's) in ``directory``; returns the files written."""
    written = []
    for name, body in (("policy_preprocessor.json", pre), ("policy_postprocessor.json", post)):
        (directory / name).write_text(json.dumps(body, indent=2) + "\n")
        written.append(directory / name)
    for name in state_files:
        save_file(tensors, str(directory / name))
        written.append(directory / name)
    return written

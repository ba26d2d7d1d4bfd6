"""LeRobot samples -> the batch dict a policy's ``forward`` takes, shaped by its
``PolicyBatchSpec`` (``PolicyFamily.batch_spec``).

The policies take ``images [B, n_cams, 3, H, W]``, uint8 as decoded (float in [0, 1] where
cameras of different sizes are resized to the model's image size first:
``PolicyBatchSpec.resize_cameras``),
``input_ids``/``attention_mask``, padded ``state``/``state_mask`` and
``action``/``action_mask`` (``action_mask`` combines the ``action_is_pad`` steps of
``delta_timestamps`` with the padded dims);
and, as their spec asks, ``embodiment_id`` and an ``image_mask`` for missing cameras.

With a Hugging Face tokenizer (``model.tokenizer``) the prompts are the policy's reference
processor's (``PolicyFamily.prompts``: e.g. pi0.5 tokenises LeRobot's prompt, GR00T
Isaac-GR00T N1.6's chat prompt). Otherwise (from-scratch runs) task strings go through
``ByteTokenizer``, a deterministic byte-level stand-in that no pretrained language model
understands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from longboat.embodied.models.common.image_preprocessing import resize_with_pad, unit_float
from longboat.embodied.models.family import PolicyBatchSpec
from longboat.embodied.models.registry import policy

STATE_KEY = "observation.state"
ACTION_KEY = "action"


class ByteTokenizer:
    """UTF-8 bytes mapped into ``[1, limit)`` (0 is padding); ids >= limit stay reserved.
    A stand-in for from-scratch runs only: no pretrained language model reads these ids."""

    def __init__(self, limit: int) -> None:
        if limit < 3:
            raise ValueError(f"ByteTokenizer needs at least 3 ids below the limit, got {limit}")
        self.limit = limit

    def encode(self, text: str) -> list[int]:
        return [1 + b % (self.limit - 1) for b in text.encode("utf-8")]


def feature_limits(model_name: str, cfg: Any) -> dict[str, tuple[str, int]]:
    """``{feature: (model config key, width)}``: the widest state and action a policy takes."""
    action_key = policy(model_name).action_width_key
    return {
        STATE_KEY: ("max_state_dim", int(cfg.max_state_dim)),
        ACTION_KEY: (action_key, int(getattr(cfg, action_key))),
    }


def batch_spec(
    model_name: str,
    cfg: Any,
    num_cameras: int,
    image_hw: tuple[int, int],
    *,
    resize_cameras: bool = False,
) -> PolicyBatchSpec:
    """The ``PolicyBatchSpec`` of a built policy config (the policy's ``batch_spec``);
    ``image_hw`` is the frame size batches carry (the model's ``input_image_size()`` with
    ``resize_cameras``)."""
    if resize_cameras:
        image_hw = tuple(cfg.input_image_size())
    return policy(model_name).batch_spec(cfg, num_cameras, image_hw, resize_cameras=resize_cameras)


def _pad_last(x: torch.Tensor, size: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    if d > size:
        raise ValueError(
            f"{what} has {d} dims but the model takes at most {size}; raise the model's "
            f"max dim (model.overrides) or drop dims from the dataset"
        )
    pad = x.new_zeros(*x.shape[:-1], size - d)
    mask = torch.cat([torch.ones(d, dtype=torch.bool), torch.zeros(size - d, dtype=torch.bool)])
    return torch.cat([x, pad], dim=-1), mask


def fit_frames(frames: torch.Tensor, spec: PolicyBatchSpec) -> torch.Tensor:
    """[..., 3, H, W] float frames -> [..., 3, *spec.image_size] (``pad_to_size``: aspect kept,
    black padding; else a plain bilinear resize with antialiasing)."""
    size = tuple(spec.image_size)
    if tuple(frames.shape[-2:]) == size:
        return frames
    if min(size) < 1:
        raise ValueError(
            f"camera frames of different sizes ({tuple(frames.shape)}) need "
            "PolicyBatchSpec.image_size (batch_spec sets it from the model config)"
        )
    lead = frames.shape[:-3]
    flat = frames.reshape(-1, *frames.shape[-3:])
    if spec.pad_to_size:
        if size[0] != size[1]:
            raise ValueError(f"pad_to_size needs a square image_size, got {size}")
        out = resize_with_pad(flat, size[0])
    else:
        out = F.interpolate(flat, size=size, mode="bilinear", antialias=True, align_corners=False)
    return out.reshape(*lead, *out.shape[-3:])


class PolicyCollator:
    """Collate LeRobotDataset samples into one policy batch (CPU tensors)."""

    def __init__(
        self,
        spec: PolicyBatchSpec,
        camera_keys: Sequence[str],
        *,
        fixed_text_length: bool = False,
        prompts: Any = None,
    ) -> None:
        """``fixed_text_length``: pad the text to ``spec.max_text_tokens`` in every batch (not
        to the batch's longest), so every batch has the same shapes (a CUDA-graphed step).
        ``prompts``: a Hugging Face tokenizer's prompts, called with the tasks, the states and
        the frames' layout (the policy's ``PromptProcessor.build``); None: the task alone
        through ``ByteTokenizer``."""
        self.spec = spec
        self.camera_keys = list(camera_keys)
        self.fixed_text_length = fixed_text_length
        self.prompts = prompts
        self.tokenizer = ByteTokenizer(spec.vocab_limit)

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        spec = self.spec
        states, state_masks, actions, action_masks, images, cam_masks, ids = (
            [],
            [],
            [],
            [],
            [],
            [],
            [],
        )
        for s in samples:
            state, smask = _pad_last(s[STATE_KEY].float(), spec.max_state_dim, STATE_KEY)
            action, dmask = _pad_last(s[ACTION_KEY].float(), spec.action_dim, ACTION_KEY)
            if action.shape[0] != spec.horizon:
                raise ValueError(
                    f"action chunk has {action.shape[0]} steps, the model's horizon is "
                    f"{spec.horizon}; the trainer's delta_timestamps must request {spec.horizon}"
                )
            step_ok = ~s.get(f"{ACTION_KEY}_is_pad", torch.zeros(spec.horizon, dtype=torch.bool))
            states.append(state)
            state_masks.append(smask)
            actions.append(action)
            action_masks.append(step_ok[:, None] & dmask[None, :])
            frames = [s[k] for k in self.camera_keys]
            if spec.resize_cameras or len({f.shape for f in frames}) > 1:
                frames = [fit_frames(unit_float(f), spec) for f in frames]
            present = [True] * len(frames)
            if spec.num_cameras is not None:
                while len(frames) < spec.num_cameras:
                    frames.append(torch.zeros_like(frames[0]))
                    present.append(False)
                frames, present = frames[: spec.num_cameras], present[: spec.num_cameras]
            images.append(torch.stack(frames))
            cam_masks.append(torch.tensor(present))
            if self.prompts is None:
                ids.append(self.tokenizer.encode(str(s.get("task", "")))[: spec.max_text_tokens])
        if len({im.shape for im in images}) > 1:  # samples of sub-datasets of other sizes
            images = [fit_frames(unit_float(im), spec) for im in images]
        if len({im.dtype for im in images}) > 1:
            images = [unit_float(im) for im in images]
        frames = torch.stack(images)
        if self.prompts is not None:
            input_ids, attention = self.prompts(
                [str(s.get("task", "")) for s in samples],
                [s[STATE_KEY] for s in samples],
                image_hw=tuple(frames.shape[-2:]),
                num_cameras=frames.shape[1],
                fixed_length=self.fixed_text_length,
            )
        else:
            input_ids, attention = self._pad_ids(ids)
        batch = {
            "images": frames,
            "input_ids": input_ids,
            "attention_mask": attention,
            "state": torch.stack(states),
            "state_mask": torch.stack(state_masks),
            "action": torch.stack(actions),
            "action_mask": torch.stack(action_masks),
        }
        if spec.with_embodiment:
            batch["embodiment_id"] = torch.stack(
                [torch.as_tensor(s.get("embodiment_id", 0), dtype=torch.int64) for s in samples]
            )
        if spec.with_image_mask:
            batch["image_mask"] = torch.stack(cam_masks)
        return batch

    def _pad_ids(self, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.spec.max_text_tokens if self.fixed_text_length else max(1, *map(len, ids))
        input_ids = torch.zeros(len(ids), length, dtype=torch.int64)
        attention = torch.zeros(len(ids), length, dtype=torch.bool)
        for row, tokens in enumerate(ids):
            input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            attention[row, : len(tokens)] = True
        return input_ids, attention


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Move every tensor of a batch (non-blocking from pinned memory where possible)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

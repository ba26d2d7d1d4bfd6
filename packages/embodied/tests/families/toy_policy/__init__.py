"""A toy policy kept outside the package: found through ``LONGBOAT_FAMILY_PATH`` (this
folder's parent), trained by the unchanged embodied run. Pooled camera colours and the state
go through an MLP trunk of residual blocks to one action chunk, trained with a masked MSE."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from longboat.embodied.models.common.freezing import FreezingGroups
from longboat.embodied.models.family import PolicyBatchSpec, PolicyFamily, flavors_of


@dataclass(kw_only=True)
class ToyConfig:
    """The toy policy's shapes and the fields ``apply_freezing`` reads."""

    max_state_dim: int = 8
    """State is zero-padded to this many dims."""
    action_dim: int = 8
    """Actions are zero-padded to this many dims."""
    action_horizon: int = 4
    """Action chunk length."""
    hidden: int = 32
    """Width of the trunk."""
    num_blocks: int = 2
    """Residual MLP blocks (the parallel blocks)."""
    image_size: tuple[int, int] = (32, 32)
    """Frame size of cameras that differ in size."""
    tune_visual: bool = True
    tune_llm: bool = True
    tune_top_llm_layers: int = 0
    tune_action_head: bool = True
    frozen_dtype: str = "bfloat16"

    FLAVORS: ClassVar[dict[str, Callable[[], ToyConfig]]]

    def input_image_size(self) -> tuple[int, int]:
        """The frame size cameras of different sizes are resized to."""
        return tuple(self.image_size)


ToyConfig.FLAVORS = {"tiny": ToyConfig}


class ToyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ToyPolicy(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.image_proj = nn.Linear(3, cfg.hidden)
        self.state_proj = nn.Linear(cfg.max_state_dim, cfg.hidden)
        self.blocks = nn.ModuleList(ToyBlock(cfg.hidden) for _ in range(cfg.num_blocks))
        self.head = nn.Linear(cfg.hidden, cfg.action_horizon * cfg.action_dim)

    def predict_action(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, horizon, action_dim]`` from the batch's frames and state."""
        images = batch["images"]
        images = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        colours = images.mean(dim=(1, 3, 4))  # [B, 3]: mean over cameras and pixels
        x = self.image_proj(colours) + self.state_proj(batch["state"].float())
        for block in self.blocks:
            x = block(x)
        return self.head(x).view(-1, self.cfg.action_horizon, self.cfg.action_dim)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pred = self.predict_action(batch)
        mask = batch["action_mask"].to(pred.dtype)
        err = F.mse_loss(pred, batch["action"].to(pred.dtype), reduction="none") * mask
        return {"loss": err.sum() / mask.sum().clamp_min(1)}

    def parallel_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def freezing_groups(self) -> FreezingGroups:
        return FreezingGroups(
            visual=[self.image_proj],
            llm_layers=[],
            llm_rest=[],
            action_head=[self.state_proj, self.blocks, self.head],
        )


def batch_spec(
    cfg: ToyConfig, num_cameras: int, image_hw: Any, *, resize_cameras: bool = False
) -> PolicyBatchSpec:
    return PolicyBatchSpec(
        max_state_dim=cfg.max_state_dim,
        action_dim=cfg.action_dim,
        horizon=cfg.action_horizon,
        max_text_tokens=8,
        vocab_limit=256,
        num_cameras=None,
        with_embodiment=False,
        with_image_mask=False,
        image_size=cfg.input_image_size(),
        resize_cameras=resize_cameras,
    )


def flops_per_sample(cfg: ToyConfig, num_cameras: int, image_hw: Any, text_len: int) -> float:
    h = cfg.hidden
    fwd = 2 * (3 * h + cfg.max_state_dim * h + cfg.num_blocks * 4 * h * h)
    fwd += 2 * h * cfg.action_horizon * cfg.action_dim
    return float(3 * fwd)


FAMILY = PolicyFamily(
    name="toy_policy",
    schema=ToyConfig,
    flavors=flavors_of(ToyConfig),
    build=ToyPolicy,
    batch_spec=batch_spec,
    synthetic_image_hw=(24, 32),
    flops_per_sample=flops_per_sample,
)

"""Random batches in each model's documented batch format (tests, smoke runs, benchmarks)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longboat.embodied.models.registry import policy_of_config


def synthetic_batch(
    model_or_cfg: nn.Module | object,
    batch_size: int = 4,
    *,
    seed: int = 0,
    image_size: tuple[int, int] | None = None,
    num_cameras: int = 2,
    text_len: int = 7,
    state_dim: int | None = None,
    action_dim: int | None = None,
    horizon: int | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """A random batch with padded state/action (real dims ``state_dim`` / ``action_dim``,
    real horizon ``horizon``), right-padded text, uint8 images (the policy's
    ``synthetic_image_hw`` unless ``image_size``; its own camera count where its batch spec
    fixes one), and, where the policy takes them, embodiment ids cycling over the first two
    embodiments and an image mask with the last camera missing."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    family = policy_of_config(cfg)
    hw = image_size or family.synthetic_image_hw
    spec = family.batch_spec(cfg, num_cameras, hw)
    if spec.num_cameras is not None:
        num_cameras = spec.num_cameras
    g = torch.Generator().manual_seed(seed)
    b = batch_size
    s_max, a_max, vocab = spec.max_state_dim, spec.action_dim, spec.vocab_limit
    h_max = spec.horizon
    s_real = state_dim or max(1, s_max - 2)
    a_real = action_dim or max(1, a_max - 3)
    h_real = horizon or max(1, h_max - 2)
    images = torch.randint(0, 256, (b, num_cameras, 3, *hw), generator=g, dtype=torch.uint8)
    input_ids = torch.randint(1, min(vocab, 500), (b, text_len), generator=g)
    attention_mask = torch.ones(b, text_len, dtype=torch.long)
    attention_mask[1::2, text_len - 2 :] = 0  # right padding on every other row
    state_mask = torch.zeros(b, s_max, dtype=torch.bool)
    state_mask[:, :s_real] = True
    state = (torch.rand(b, s_max, generator=g) * 2 - 1) * state_mask
    action_mask = torch.zeros(b, h_max, a_max, dtype=torch.bool)
    action_mask[:, :h_real, :a_real] = True
    action = torch.randn(b, h_max, a_max, generator=g) * action_mask
    batch = {
        "images": images,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "state": state,
        "state_mask": state_mask,
        "action": action,
        "action_mask": action_mask,
    }
    if spec.with_embodiment:
        batch["embodiment_id"] = torch.arange(b) % min(2, getattr(cfg, "num_embodiments", 1))
    if spec.with_image_mask:
        image_mask = torch.ones(b, num_cameras, dtype=torch.bool)
        image_mask[:, -1] = False  # one camera missing
        batch["image_mask"] = image_mask
    return {k: v.to(device) for k, v in batch.items()}

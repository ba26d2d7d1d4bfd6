"""Random batches in each model's documented batch format (tests, smoke runs, benchmarks)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longboat.embodied.models.groot_n1_6.config import GrootN16Config
from longboat.embodied.models.pi05.config import Pi05Config


def synthetic_batch(
    model_or_cfg: nn.Module | GrootN16Config | Pi05Config,
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
    real horizon ``horizon``), right-padded text, uint8 images, and for GR00T embodiment
    ids cycling over the first two embodiments."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    g = torch.Generator().manual_seed(seed)
    b = batch_size
    if isinstance(cfg, GrootN16Config):
        s_max, a_max, vocab = cfg.max_state_dim, cfg.max_action_dim, cfg.llm.vocab_size
        h_max, hw = cfg.action_horizon, image_size or (56, 84)
    elif isinstance(cfg, Pi05Config):
        s_max, a_max, vocab = cfg.max_state_dim, cfg.action_dim, cfg.bin_offset
        h_max, hw = cfg.action_horizon, image_size or (56, 56)
        num_cameras = cfg.num_cameras
    else:
        raise TypeError(f"no synthetic batch for {type(cfg).__name__}")
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
    if isinstance(cfg, GrootN16Config):
        batch["embodiment_id"] = torch.arange(b) % min(2, cfg.num_embodiments)
    else:
        image_mask = torch.ones(b, num_cameras, dtype=torch.bool)
        image_mask[:, -1] = False  # one camera missing
        batch["image_mask"] = image_mask
    return {k: v.to(device) for k, v in batch.items()}

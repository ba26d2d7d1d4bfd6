"""Lean baseline of ``tools/bench/vla_throughput.py`` (``--runs lean``): the policy's own model
math in plain eager PyTorch, with nothing a training framework adds and nothing a reference
loop wastes.

- Model: longboat's ``build_model`` of the same family, flavour and overrides (the same
  parameters and math as the ``longboat`` runs), its every op through the torch references
  (``LONGBOAT_KERNELS_IMPL=torch`` while the run lasts: no Triton kernels; attention is
  ``F.scaled_dot_product_attention``), frozen as configured, frozen weights in bf16, trainable
  ones in fp32 under bf16 autocast.
- Data: a few synthetic batches (``models.synthetic.synthetic_batch``: uint8 frames at the
  benchmark's size, the prompt length the FLOP count assumes) made once on the device and
  cycled: no decoding, no collation, no host-to-device copies.
- Step: ``zero_grad(set_to_none=True)``, forward, backward, ``clip_grad_norm_(1.0)``
  (foreach), torch's fused AdamW; no host read per step (the losses are read after the
  timed window). No LM head, no thrown-away work.

What it shows: how much of ``longboat``'s speed comes from the framework's engineering (the
data path, master weights, the one-pass update, the CUDA-graphed step, Triton kernels)
rather than from the reference loops' waste.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

KERNELS_ENV = "LONGBOAT_KERNELS_IMPL"


def run_lean(
    model_name: str,
    flavor: str,
    overrides: dict[str, Any],
    *,
    batch: int,
    image_hw: tuple[int, int],
    text_len: int,
    acc: Any,
    warmup: int,
    steps: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Build, train ``warmup + steps`` steps (the last ``steps`` timed by ``time_loop``) and
    return the run's timing, losses, peak memory and parameter counts."""
    from bench_env import free_memory
    from bench_timing import time_loop

    from longboat.embodied.models import apply_freezing, build_model, get_config
    from longboat.embodied.models.synthetic import synthetic_batch

    saved = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = "torch"
    try:
        leftover = free_memory(acc)
        device = acc.device()
        torch.manual_seed(seed)
        cfg = get_config(model_name, flavor, overrides)
        model = build_model(model_name, cfg)
        counts = apply_freezing(model, cfg)
        model.to(device).train()
        params = [p for p in model.parameters() if p.requires_grad]
        fused = {"fused": True} if acc.device_type == "cuda" else {"foreach": True}
        opt = torch.optim.AdamW(
            params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=1e-5, **fused
        )
        cams = getattr(cfg, "num_cameras", None) or 2
        data = [
            synthetic_batch(
                cfg,
                batch,
                seed=seed + i,
                image_size=image_hw,
                num_cameras=cams,
                text_len=text_len,
                device=device,
            )
            for i in range(4)
        ]
        dtype = torch.bfloat16

        def step(b: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(acc.device_type, dtype=dtype):
                loss = model(b)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            return loss.detach()

        timing, losses = time_loop(acc, itertools.cycle(data), step, warmup, steps)
        peak = acc.memory_stats().get("peak_allocated_gb", 0.0)
        return {"timing": timing, "losses": losses, "peak_mem_gb": peak, "params": counts,
                "items_per_step": batch, "allocated_at_start_gb": leftover}  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = saved

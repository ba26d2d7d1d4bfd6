"""The Wan baseline: a DiffSynth-Studio-style training loop on diffusers' ``WanTransformer3DModel``.

``WanRefStep`` runs one flow-matching step on precomputed latents and text embeddings, batch 1:

- ``hf_ckpt`` (the reference): gradient checkpointing on every block (diffusers'
  ``enable_gradient_checkpointing``: non-reentrant ``torch.utils.checkpoint`` per
  ``WanTransformerBlock``, as DiffSynth-Studio forces for Wan), eager.
- ``hf_compiled``: every block ``torch.compile``d, no checkpointing (the fastest diffusers loop
  that fits one H200 at these shapes).

Both: fp32 weights under bf16 autocast on a GPU (fp32 without autocast on CPU, where the
product's ``diffusion.cpu_precision`` is fp32 too), ``torch.optim.AdamW(fused=True)`` over every
parameter with ``optim``'s lr, betas, eps and weight decay, constant LR, no gradient clipping.
The loss is Wan's flow matching: a noise level ``sigma`` drawn uniformly on ``(0, 1]`` and
shifted by ``shift`` (5), ``x_t = (1 - sigma) x0 + sigma noise``, the model fed ``sigma * 1000``,
target ``noise - x0``, the MSE (fp32) times DiffSynth-Studio's bell weight of that level.
``draw_noise`` makes a step's level and noise from one seed in a fixed order (the level's
``rand`` first, then ``randn`` of the latent shape, on the CPU), the order the product's
objective draws them in, so a benchmark hands both sides the same seed per step and both see
the same noise.

How it differs from DiffSynth-Studio's Wan trainer (``examples/wanvideo/model_training/
train.py`` with ``diffsynth/diffusion/runner.py`` and ``loss.py``), and why:

1. The model is diffusers' ``WanTransformer3DModel``, not DiffSynth's own ``WanModel``: the same
   architecture and math (its ``config.json`` is what ``longboat-diffusion`` loads, so both
   sides start from one set of weights), with diffusers' SDPA attention where DiffSynth calls
   flash-attn when installed (SDPA runs the flash kernel for bf16 on the H200; flash-attn is not
   on the benchmark machine).
2. fp32 weights under bf16 autocast; DiffSynth holds the DiT in bf16 and lets AdamW update bf16
   weights. The product keeps fp32 main weights, so the baseline gets the same precision recipe
   (a pure-bf16 loop trades update precision for memory and speed: another recipe). Under
   autocast diffusers' q / k RMSNorm gets bf16 activations with fp32 weights, which torch
   runs unfused: what every autocast user of diffusers' Wan gets.
3. The noise level is drawn continuously (the product's Wan default); DiffSynth picks one of
   its 1,000 shifted training levels. The weight is DiffSynth's formula (``exp(-2 (sigma -
   1/2)^2)`` less its minimum, scaled to mean 1 over those 1,000 levels) evaluated at that level:
   on the grid it is DiffSynth's table.
4. The noise is drawn on the CPU from a seeded generator and copied over (DiffSynth draws
   ``randn_like`` on the device), so both sides of the benchmark see the same noise; the
   product draws it the same way.
5. Latents and text embeddings are precomputed (DiffSynth's two-stage ``sft:data_process`` /
   ``sft:train`` split); the text has 512 tokens, as Wan's UMT5 encoder pads captions to 512.
6. No Accelerate object and no per-step ``loss.item()`` or logger (their host work is left out,
   which only favours the baseline); fused AdamW (DiffSynth's default is foreach); no gradient
   clipping and weight decay on every parameter, as in DiffSynth's runner.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .reference_adamw import ReferenceAdamW

WAN_T2V_1_3B: dict[str, Any] = dict(
    patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128, in_channels=16,
    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
)  # fmt: skip
"""diffusers' ``config.json`` of Wan2.1-T2V-1.3B (architecture keys)."""
WAN_TINY: dict[str, Any] = dict(WAN_T2V_1_3B, num_attention_heads=2, attention_head_dim=12,
                                text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2)  # fmt: skip
"""A CPU-sized Wan of the same structure (head dim 12: rotary split 4 / 4 / 4)."""


def hf_wan(config: Mapping[str, Any], device: torch.device, state_dict: Any = None) -> Any:
    """A ``WanTransformer3DModel`` of ``config`` on ``device`` in fp32, training mode; with
    ``state_dict`` (diffusers names) its weights, else diffusers' random init."""
    from diffusers import WanTransformer3DModel

    with torch.device(device):
        model = WanTransformer3DModel(**config)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model.float().train()


def shift_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's timestep shift ``shift * u / (1 + (shift - 1) * u)``."""
    return shift * u / (1.0 + (shift - 1.0) * u)


def bell_weight(sigma: torch.Tensor, shift: float, levels: int = 1000) -> torch.Tensor:
    """DiffSynth-Studio's Wan loss weight at noise level ``sigma`` (see the module doc, 3)."""
    grid = shift_sigmas(torch.linspace(1.0, 0.0, levels + 1, dtype=torch.float64)[:-1], shift)

    def bell(s: torch.Tensor) -> torch.Tensor:
        return torch.exp(-2.0 * (s * levels - levels / 2) ** 2 / levels**2)

    low = bell(grid).min()
    w = (bell(sigma.double().cpu()) - low) / (bell(grid) - low).mean()
    return w.float()


def draw_noise(
    seed: int, shape: tuple[int, ...], shift: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's noise level ``[1]`` (shifted, float32) and noise (float32, ``shape``) from
    ``seed``: one ``rand`` in float64 for the level (``u`` in ``(0, 1]``), then ``randn``."""
    gen = torch.Generator().manual_seed(seed)
    u = 1.0 - torch.rand(1, generator=gen, dtype=torch.float64)
    sigma = shift_sigmas(u, shift).float()
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    return sigma, noise


class WanRefStep:
    """``step(batch) -> loss``: noise, forward, backward, AdamW (see the module doc).

    ``batch``: ``latents`` ``[1, C, T, H, W]`` and ``text`` ``[1, L, D]`` (float32, any
    device), ``seed`` (this step's noise seed) and, with ``lr_factor``, ``step`` (its index).

    ``lr_factor`` (loss alignment): the product's optimizer settings instead of DiffSynth's:
    the LR ``optim.lr * lr_factor(step)``, weight decay on matrices only, clipping at
    ``optim.grad_clip``."""

    def __init__(
        self,
        model: Any,
        optim: Any,
        device: torch.device,
        *,
        compiled: bool,
        shift: float,
        num_train_timesteps: int = 1000,
        compile_backend: str = "inductor",
        lr_factor: Callable[[int], float] | None = None,
        autocast: bool | None = None,
    ) -> None:
        if compiled:
            for block in model.blocks:
                block.compile(backend=compile_backend)
        else:
            model.enable_gradient_checkpointing()
        self.checkpointing = bool(model.gradient_checkpointing)
        self.forward_module = type(model).forward.__module__
        product = lr_factor is not None  # the product's optimizer: matrices decay, clipping
        self.optimizer = ReferenceAdamW(
            model, optim, device, clip=optim.grad_clip if product else 0.0,
            lr_factor=lr_factor, matrices_only=product,
        )  # fmt: skip
        self.model, self.device = model, device
        self.shift, self.timesteps = float(shift), int(num_train_timesteps)
        self.autocast = device.type == "cuda" if autocast is None else autocast
        self.precision = "bf16 autocast, fp32 weights" if self.autocast else "fp32"

    def __call__(self, batch: dict[str, Any]) -> torch.Tensor:
        x0 = batch["latents"].to(self.device, torch.float32, non_blocking=True)
        text = batch["text"].to(self.device, torch.float32, non_blocking=True)
        sigma, noise = draw_noise(int(batch["seed"]), tuple(x0.shape), self.shift)
        weight = bell_weight(sigma, self.shift, self.timesteps).to(self.device)
        sigma, noise = sigma.to(self.device), noise.to(self.device, non_blocking=True)
        s = sigma.reshape(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise
        target = noise - x0
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            pred = self.model(x_t, sigma * self.timesteps, text, return_dict=False)[0]
        loss = (weight * F.mse_loss(pred.float(), target.float())).sum()
        loss.backward()
        self.optimizer.update(int(batch.get("step", 0)))
        return loss.detach()

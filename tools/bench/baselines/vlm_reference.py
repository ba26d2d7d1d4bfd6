"""The VLM baseline: Hugging Face ``Qwen2_5_VLForConditionalGeneration`` (or
``Qwen3VLMoeForConditionalGeneration``) as a plain training loop.

``HFVLMStep`` (``hf``, ``hf_compiled``, ``hf_liger``): the model built from the longboat
config's shapes (``to_hf_config``; SDPA attention, random init), fp32 weights under bf16
autocast (the HF Trainer's ``bf16=True``), ``torch.optim.AdamW(fused=True)`` decaying matrices
only, ``clip_grad_norm_`` at ``optim.grad_clip``, the loss from ``labels`` (transformers shifts
them). ``compiled``: every ViT block and decoder layer ``torch.compile``d (``dynamic=True``:
the samples differ in length and image grid); ``liger``: ``apply_liger_kernel_to_qwen2_5_vl``
before the build (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy). Gradient checkpointing
is off (the benchmark sample fits on one H200 without it).

How it differs from a user's HF Trainer run: no ``Trainer`` object (its per-step host work is
left out, which only favours the baseline) and a constant LR (the loss alignment passes
``lr_factor``: the product's warm-up and decay, as the Trainer's scheduler would follow
them). It gets one sample per step,
unpacked (HF has no packing with per-sample attention under SDPA); the benchmark's samples
each fill one longboat row, so both sides see the same tokens and images per step.

Qwen3-VL-MoE (``hf_qwen3_vl_moe``): the model built from the family's own export config
(``qwen3_vl_moe.model.to_hf_config``; SDPA attention, random init from the seeded RNG), every
decoder layer sparse, ``output_router_logits=True`` so the loss is cross-entropy +
``router_aux_loss_coef`` x transformers' load-balancing loss, the experts through
transformers' ``grouped_mm`` implementation (one grouped GEMM per projection; its fastest
built-in; ``hf_experts_kernel`` says which kernel ran: with the fp32 weights of the bf16
autocast recipe the grouped GEMMs run in fp32, since autocast does not cover them).
The training step is the same ``HFVLMStep``.

``load_qwen2_5_vl`` (the loss alignment): the same model read from a saved checkpoint in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .llm_reference import hf_experts_kernel
from .reference_adamw import ReferenceAdamW

__all__ = ["HFVLMStep", "hf_batch", "hf_experts_kernel", "hf_qwen2_5_vl", "hf_qwen3_vl_moe",
           "load_qwen2_5_vl"]  # fmt: skip


def hf_qwen2_5_vl(model_cfg: Any, device: torch.device, *, liger: bool = False) -> Any:
    """A randomly initialised ``Qwen2_5_VLForConditionalGeneration`` of ``model_cfg``'s shapes."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from longboat.vlm.models.qwen2_5_vl.model import to_hf_config

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2_5_vl

        apply_liger_kernel_to_qwen2_5_vl()
    cfg = to_hf_config(model_cfg)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    return model.float().train()


def hf_qwen3_vl_moe(model_cfg: Any, device: torch.device) -> Any:
    """A randomly initialised ``Qwen3VLMoeForConditionalGeneration`` of ``model_cfg``'s shapes
    (a ``Qwen3VLMoeConfig``): SDPA, the ``grouped_mm`` experts, the load-balancing loss in
    the training loss, fp32 weights, in training mode."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from longboat.vlm.models.qwen3_vl_moe.model import to_hf_config

    cfg = to_hf_config(model_cfg)
    cfg.text_config.output_router_logits = True
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"  # transformers' fastest built-in experts
    with torch.device(device):
        model = Qwen3VLMoeForConditionalGeneration(cfg)
    return model.float().train()


def load_qwen2_5_vl(hf_dir: str | Path, device: torch.device) -> Any:
    """``Qwen2_5_VLForConditionalGeneration`` from ``hf_dir`` in fp32 with SDPA attention, on
    ``device``, in training mode."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.to(device).train()


def hf_batch(row: dict[str, Any], image_token_id: int, video_token_id: int) -> dict[str, Any]:
    """One packed longboat row (one sample + padding) as transformers' inputs: the sample's
    tokens unpadded, labels unshifted (-100 where the row's ``loss_mask`` has no target)."""
    n = int(row["cu_seqlens"][1])
    ids = row["input_ids"][:, :n]
    labels = torch.full_like(ids, -100)
    keep = row["loss_mask"][:, : n - 1] > 0
    labels[:, 1:] = torch.where(keep, ids[:, 1:], labels[:, 1:])
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == image_token_id] = 1
    types[ids == video_token_id] = 2
    return {
        "input_ids": ids,
        "labels": labels,
        "mm_token_type_ids": types,
        "pixel_values": row["pixel_values"],
        "image_grid_thw": row["image_grid_thw"],
    }


class HFVLMStep:
    """``step(batch, i=0) -> loss``: forward, backward, clip, AdamW (see the module doc).

    ``lr_factor``: the LR of update ``i`` is ``optim.lr * lr_factor(i)`` (else constant);
    ``autocast``: bf16 autocast over the fp32 weights (default), else fp32 throughout."""

    def __init__(
        self,
        model: Any,
        optim: Any,
        device: torch.device,
        *,
        compiled: bool,
        lr_factor: Callable[[int], float] | None = None,
        autocast: bool = True,
    ) -> None:
        if compiled:
            inner = model.model
            for block in [*inner.visual.blocks, *inner.language_model.layers]:
                block.compile(dynamic=True)
        self.forward_module = type(model).forward.__module__
        self.optimizer = ReferenceAdamW(
            model, optim, device, clip=optim.grad_clip, lr_factor=lr_factor
        )
        self.model, self.device, self.autocast = model, device, autocast

    def __call__(self, batch: dict[str, Any], i: int = 0) -> torch.Tensor:
        inputs = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(**inputs, use_cache=False).loss  # training: no KV cache
        loss.backward()
        self.optimizer.update(i)
        return loss.detach()

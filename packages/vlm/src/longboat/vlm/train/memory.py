"""The VLM run's memory plan: the vision tower (``models/tower_memory.py``, at the most
patches any packed row holds) and the decoder (core's ``DecoderShapes``: megatron's logits
loss, its rotary under M-RoPE) as one ``ComposedShapes``, planned by core's
``plan_megatron_run`` with the stack's recompute modes (none, full) and the micro-batch held
at one packed row.

The optimizer state counts frozen components (``model.freeze``; LoRA's frozen decoder) as
frozen whole: the projector's share of a frozen tower and the adapters of a LoRA decoder are
not told apart (each a small fraction of the state).
"""

from __future__ import annotations

from typing import Any


def most_patches_in_a_row(rows: Any) -> int:
    """The most vision patches (images and video frames, before merging) any packed row of
    ``rows`` holds: the tower's tokens at the run's peak."""
    most = 0
    for pieces in rows.rows:
        docs = {p.doc for p in pieces}
        n = 0
        for doc in docs:
            sample = rows.samples[doc]
            for grid in (sample.image_grid_thw, sample.video_grid_thw):
                if grid is not None and len(grid):
                    n += int(grid.prod(-1).sum())
        most = max(most, n)
    return most


def plan_vlm_memory(run: Any) -> Any:
    """The memory plan of ``run`` (a ``VLMTraining`` whose data and parallel layout are
    open; ``train.memory_budget``, module doc), its ``train.recompute`` written back (applying
    to the components ``train.recompute_components`` names, null: both). A str (the plan's
    line) where the family's tower has no estimate (no ``tower_shapes`` in its module)."""
    from longboat.core.megatron.engine.memory_plan import DecoderShapes, OptimizerPlan
    from longboat.core.megatron.engine.memory_shapes import (
        ComposedShapes,
        plan_megatron_run,
        trainable_fraction,
        unplanned,
    )
    from longboat.core.megatron.engine.moments import moment_plan_fields
    from longboat.vlm.models.common import RECOMPUTE_COMPONENTS

    cfg, t, m, lay = run.cfg, run.cfg.train, run.model_cfg, run.layout
    tower_shapes = getattr(run.family.load(), "tower_shapes", None)
    if tower_shapes is None:
        return unplanned(t, f"the {run.family.name} family's vision tower has no estimate")
    e = 4 if run.precision == "fp32" else 2
    rows = run.data.train
    patches = most_patches_in_a_row(rows)
    vit_tp = cfg.model.vision_tensor_parallel or lay.tensor_parallel
    tower = tower_shapes(m.vision, tokens=patches, weight_bytes=e, tensor_parallel=vit_tp)
    decoder = DecoderShapes.of(m.language, seq_len=rows.seq_len, precision=run.precision,
                               layout=lay, fused_ce=False,
                               fused_qkv_rope=m.language.mrope_section is None)  # fmt: skip
    parts = t.recompute_components or RECOMPUTE_COMPONENTS
    shapes = ComposedShapes(decoder=decoder, encoders=(tower,),
                            recompute_encoders="vision" in parts,
                            recompute_decoder="language" in parts,
                            extra_batch_bytes=patches * m.vision.patch_dim * e)  # fmt: skip
    frozen = tower.params() if "vision" in cfg.model.freeze else 0
    if "language" in cfg.model.freeze or cfg.lora.enabled:
        frozen += decoder.stage_params(0)
    total = shapes.stage_params(0)
    opt = OptimizerPlan(
        data_parallel=lay.data_parallel,
        precision=run.precision,
        optimizer=cfg.optim.name,
        trainable_fraction=trainable_fraction(total - frozen, total),
        bf16_grads_single_pass=False,  # the VLM's grad buffers are fp32
        **moment_plan_fields(cfg),
    )
    return plan_megatron_run(t, shapes, opt, run.accelerator, data_parallel=lay.data_parallel,
                             micro_batch_pinned=True, recompute_modes=("none", "full"),
                             optim=cfg.optim)  # fmt: skip

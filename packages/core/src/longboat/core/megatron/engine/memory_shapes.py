"""The megatron memory plan beyond a plain decoder, and the one call every megatron stack
makes to plan its run.

- ``EncoderShapes``: a stack of bidirectional transformer blocks (a ViT: megatron
  ``TransformerLayer`` s with biases on every linear, RMSNorm or LayerNorm, a SwiGLU or plain
  MLP, attention over packed segments with a 2D rotary embedding), its parameters and what
  each block saves for the backward, as the estimator counts a decoder layer's
  (``memory_plan`` module doc); the parts outside the blocks (patch embedding, merger) come
  from the stack as exact counts.
- ``ComposedShapes``: a decoder (``DecoderShapes``) with encoders on the first pipeline stage
  (a VLM's vision tower), one recompute choice applying to each part that takes it.
- ``plan_megatron_run``: what llm, vlm and diffusion call: ``memory_plan.plan_run_memory``
  on the run's ``train`` section, the choice written back into it (``train.recompute`` and,
  split, ``train.micro_batch_size`` with the global batch kept; bf16 moments chosen:
  ``optim.moment_dtype``); ``unplanned`` where a model has no estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from longboat.core.engine.memory.plan import RECOMPUTE_ORDER, MemoryPlan
from longboat.core.megatron.engine.memory_plan import (
    DecoderShapes,
    OptimizerPlan,
    plan_run_memory,
)


@dataclass(frozen=True, kw_only=True)
class EncoderShapes:
    """A ViT's blocks on one rank at ``tokens`` patches a microbatch (module doc)."""

    hidden: int
    """Block width."""
    ffn: int
    """MLP inner width (a SwiGLU's: each of its two halves)."""
    layers: int
    """Blocks."""
    heads: int
    """Attention heads (multi-head: keys and values have as many)."""
    head_dim: int
    """Per-head width."""
    tokens: int
    """Patches of one microbatch (the largest the run's data holds)."""
    gated: bool = True
    """SwiGLU MLP (else a plain one: GELU between two linears)."""
    layer_norm: bool = False
    """LayerNorm (mean and rstd kept) instead of RMSNorm (rstd)."""
    rotary: bool = True
    """A rotary embedding on q / k (megatron's: cos / sin kept per rotation)."""
    tensor_parallel: int = 1
    weight_bytes: int = 2
    """Bytes of a weight and of an activation."""
    other_params: int = 0
    """Parameters outside the blocks (patch / position embedding, merger), exact."""
    other_saved: int = 0
    """Bytes the parts outside the blocks save for the backward at one microbatch."""

    def block_params(self) -> int:
        """Parameters of one block on this rank (biases on every linear)."""
        h, f, tp = self.hidden, self.ffn, self.tensor_parallel
        norms = 2 * (2 * h if self.layer_norm else h)
        attention = 3 * h * h // tp + 3 * h // tp + h * h // tp + h
        up = 2 * f // tp if self.gated else f // tp
        return norms + attention + up * h + up + f // tp * h + h

    def params(self) -> int:
        """Parameters of the whole encoder on this rank."""
        return self.layers * self.block_params() + self.other_params

    def block_saved(self, micro_batch: int, recompute: str) -> int:
        """Bytes one block saves for its backward at ``micro_batch`` microbatch(es): with
        full recompute its input; else the norms' inputs and outputs with their statistics,
        q / k / v and the attention output with its log-sum-exp (the qkv output behind v
        counted whole), the rotations' cos / sin, the MLP's inner activations."""
        t, e, h = micro_batch * self.tokens, self.weight_bytes, self.hidden
        if recompute == "full":
            return e * t * h
        a, d, tp = self.heads // self.tensor_parallel, self.head_dim, self.tensor_parallel
        stats = 8 if self.layer_norm else 4
        n = 4 * e * t * h + 2 * stats * t  # norm inputs and outputs, their statistics
        n += 6 * e * t * a * d + 4 * t * a  # q, k, the qkv output, attention out + lse
        n += 4 * e * t * d if self.rotary else 0
        n += (3 if self.gated else 2) * e * t * self.ffn // tp
        return n

    def saved(self, micro_batch: int, recompute: str) -> int:
        """Bytes the encoder keeps for the backward at ``micro_batch`` microbatch(es)."""
        n = self.layers * self.block_saved(micro_batch, recompute)
        if recompute == "full" and self.rotary:  # the fp32 angle table the blocks share
            n += 4 * micro_batch * self.tokens * self.head_dim
        return n + micro_batch * self.other_saved

    def backward_workspace(self, micro_batch: int, recompute: str) -> int:
        """The backward's working set inside one block (the gradients of its widest
        activations, plus a recomputed block's activations)."""
        t, e = micro_batch * self.tokens, self.weight_bytes
        width = (3 if self.gated else 2) * self.ffn // self.tensor_parallel
        n = 2 * e * t * self.hidden + e * t * width
        if recompute == "full":
            n += self.block_saved(micro_batch, "none")
        return n

    def batch_bytes(self, micro_batch: int) -> int:
        """Not counted here: the pixels are in the composed model's batch."""
        return 0


@dataclass(frozen=True, kw_only=True)
class ComposedShapes:
    """A decoder with encoders on its first pipeline stage, as one ``StagedShapes``."""

    decoder: DecoderShapes
    encoders: tuple[EncoderShapes, ...] = ()
    recompute_encoders: bool = True
    """Whether the run's recompute applies to the encoders (else they keep everything)."""
    recompute_decoder: bool = True
    """Whether it applies to the decoder."""
    extra_batch_bytes: int = 0
    """Bytes of a microbatch beyond the decoder's tokens (pixels, grids)."""

    @property
    def pipeline_parallel(self) -> int:
        """The decoder's pipeline stages."""
        return self.decoder.pipeline_parallel

    def _mode(self, recompute: str, applies: bool) -> str:
        return recompute if applies else "none"

    def stage_params(self, stage: int = 0) -> int:
        """The decoder stage's parameters, plus the encoders' on the first."""
        n = self.decoder.stage_params(stage)
        return n + (sum(e.params() for e in self.encoders) if stage == 0 else 0)

    def stage_fp32_params(self, stage: int = 0) -> int:
        """None: the encoders' norms take the weights' dtype too (``specs.ParamsDtypeNorm``),
        and the decoder's parameters all do."""
        return 0

    def stage_saved(
        self, stage: int, micro_batch: int, recompute: str, full_layers: int | None = None
    ) -> int:
        """The decoder stage's saved bytes, plus the encoders' on the first."""
        mode = self._mode(recompute, self.recompute_decoder)
        n = self.decoder.stage_saved(stage, micro_batch, mode, full_layers)
        if stage == 0:
            mode = self._mode(recompute, self.recompute_encoders)
            n += sum(e.saved(micro_batch, mode) for e in self.encoders)
        return n

    def stage_tail(self, stage: int, micro_batch: int) -> tuple[int, int]:
        """The decoder's head on its last stage."""
        return self.decoder.stage_tail(stage, micro_batch)

    def backward_workspace(self, micro_batch: int, recompute: str) -> int:
        """The largest working set of any part."""
        parts = [self.decoder.backward_workspace(micro_batch,
                                                 self._mode(recompute, self.recompute_decoder))]  # fmt: skip
        mode = self._mode(recompute, self.recompute_encoders)
        parts += [e.backward_workspace(micro_batch, mode) for e in self.encoders]
        return max(parts)

    def batch_bytes(self, micro_batch: int) -> int:
        """The decoder's token tensors and the encoders' inputs."""
        return self.decoder.batch_bytes(micro_batch) + micro_batch * self.extra_batch_bytes


def plan_megatron_run(
    train: Any,
    shapes: Any,
    opt: OptimizerPlan,
    accelerator: Any,
    *,
    data_parallel: int,
    micro_batch_pinned: bool = False,
    recompute_modes: Sequence[str] = RECOMPUTE_ORDER,
    layers_mode: str = "full",
    optim: Any = None,
) -> MemoryPlan:
    """The run's memory plan (``train.memory_budget``) for ``shapes`` (a ``StagedShapes``),
    its choice written back into ``train``: ``recompute`` and, split, ``micro_batch_size``
    (the global batch kept); into ``optim`` (the run's ``optim`` section), where the plan
    chose bf16 moments (``opt.allow_bf16_moments``), ``moment_dtype``.
    ``micro_batch_pinned``: the micro-batch stays whole (one microbatch a step captured as a
    graph, a packed row); ``recompute_modes``: the modes the
    stack offers for the plan to choose from, least first; ``layers_mode``: the mode a set
    ``train.recompute_layers`` pins when ``train.recompute`` is null. A run that cannot fit
    raises ``ConfigError`` with the numbers (``memory_plan.choose_decoder_plan``)."""
    from longboat.core.data.batch_plan import batch_layout

    layout = batch_layout(train.global_batch_size, train.micro_batch_size, data_parallel)
    plan = plan_run_memory(
        train,
        shapes,
        opt,
        accelerator,
        accum=layout.accum,
        micro_batch_pinned=micro_batch_pinned,
        recompute_modes=recompute_modes,
        layers_mode=layers_mode,
    )
    train.recompute = plan.choice.recompute
    if optim is not None and plan.choice.moment_bytes != opt.moment_bytes:
        optim.moment_dtype = "bf16" if plan.choice.moment_bytes == 2 else "fp32"
    if plan.choice.micro_batch != train.micro_batch_size:
        train.global_batch_size = layout.global_batch
        train.micro_batch_size = plan.choice.micro_batch
    return plan


def unplanned(train: Any, why: str) -> str:
    """The plan's line where a model has no estimate (``why``): ``train.recompute`` left as
    set, none where null."""
    train.recompute = train.recompute or "none"
    return f"Memory plan: none ({why}; set train.recompute to choose)."


def trainable_fraction(trainable: int, total: int) -> float:
    """``OptimizerPlan.trainable_fraction`` of ``trainable`` of ``total`` parameters."""
    return trainable / total if total else 1.0


__all__ = [
    "ComposedShapes",
    "EncoderShapes",
    "plan_megatron_run",
    "trainable_fraction",
    "unplanned",
]

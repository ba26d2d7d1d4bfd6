"""The diffusion run's memory plan: a Wan DiT's shapes as core's megatron memory plan reads
them (``WanShapes``, a ``StagedShapes``), planned by core's ``plan_megatron_run`` with the
stack's recompute modes, which keep their meanings: ``selective`` (each recomputed block
keeps its input and its self-attention's outputs), ``full`` (only its input);
``train.recompute_layers`` recomputes only the first n blocks of either.

What a block saves for its backward, with longboat's kernels (LayerNorm / RMSNorm kernels,
fused attention): the residual stream and the tensors derived from it per token (the two
adaLN modulations' inputs and outputs with their statistics, the qk-norms' inputs, the
cross-attention norm, the gated adds' operands: eleven ``tokens x hidden`` tensors and ten
fp32 statistics a token), q / k / v and the output of the self-attention and q and the
output of the cross-attention with their log-sum-exps, the caption's keys and values, and
the feed-forward's two inner activations. Outside the blocks: the patch embedding's input,
the caption and time embedders, the rotary tables (fp32), the final adaLN, the output
projection's input and the fp32 prediction the loss reads. Tokens are a micro-batch's: the
largest latent shape times the micro-batch (same-shape batches), or ``data.max_tokens``
(packed batches, whose micro-batch the plan does not split), over the context-parallel ranks.

A family without a ``WanConfig`` (FLUX) runs unplanned, its line says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class WanShapes:
    """A Wan DiT on one rank at the run's token counts (module doc)."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    head_dim: int
    patch_dim: int
    """Latent channels x patch volume (the patch embedding's input width)."""
    out_patch_dim: int
    """The prediction's width per token."""
    text_dim: int
    freq_dim: int
    tokens: int
    """Tokens of one micro-batch unit (a sample, or a pack) on this rank."""
    captions: int = 1
    """Captions one micro-batch unit holds."""
    text_len: int = 512
    """Tokens of the longest caption."""
    cross_attn_norm: bool = True
    tensor_parallel: int = 1
    weight_bytes: int = 2
    input_bytes: int = 4
    """Bytes of a latent / caption element in the batch."""
    pipeline_parallel: int = 1
    """Always 1: the DiT is not pipelined."""

    # --- parameters ---------------------------------------------------------------------

    def block_params(self) -> int:
        """Parameters of one block on this rank: self- and cross-attention (four linears
        with biases and two qk-norms each), the cross-attention norm, the feed-forward, the
        modulation table."""
        h, f, tp = self.hidden, self.ffn, self.tensor_parallel
        attention = 3 * (h * h // tp + h // tp) + h * h // tp + h + 2 * h // tp
        n = 2 * attention + (2 * h if self.cross_attn_norm else 0)
        return n + h * f // tp + f // tp + f // tp * h + h + 6 * h

    def block_fp32_params(self) -> int:
        """Of those, kept in fp32: the qk-norms, the cross-attention norm, the table."""
        h = self.hidden
        return 4 * h // self.tensor_parallel + (2 * h if self.cross_attn_norm else 0) + 6 * h

    def stage_params(self, stage: int = 0) -> int:
        """The whole model on this rank: the blocks, the patch, time and caption embedders,
        the output projection and its modulation table."""
        h = self.hidden
        n = self.layers * self.block_params() + self.patch_dim * h + h
        n += self.freq_dim * h + h + h * h + h + h * 6 * h + 6 * h  # time embedder, time_proj
        n += self.text_dim * h + h + h * h + h  # caption embedder
        return n + h * self.out_patch_dim + self.out_patch_dim + 2 * h

    def stage_fp32_params(self, stage: int = 0) -> int:
        """The blocks' fp32 parameters and the output's modulation table."""
        return self.layers * self.block_fp32_params() + 2 * self.hidden

    # --- activations --------------------------------------------------------------------

    def block_saved(self, micro_batch: int, recompute: str) -> int:
        """Bytes one block saves for its backward (module doc): everything; with selective
        recompute its input and its self-attention's output and log-sum-exp; with full its
        input."""
        t, e, h = micro_batch * self.tokens, self.weight_bytes, self.hidden
        a, tp = self.heads // self.tensor_parallel, self.tensor_parallel
        if recompute == "full":
            return e * t * h
        if recompute == "selective":
            return e * t * h + e * t * h // tp + 4 * t * a
        text = micro_batch * self.captions * self.text_len
        n = 11 * e * t * h + 40 * t  # the stream's tensors and their statistics
        n += 6 * e * t * h // tp + 8 * t * a  # q, k, v, out; cross q, out; two lse
        n += 2 * e * text * h // tp  # the caption's keys and values
        return n + 2 * e * t * self.ffn // tp

    def outside_saved(self, micro_batch: int) -> int:
        """Bytes saved outside the blocks before them: the patch embedding's input, the
        caption and time embedders' activations, the rotary tables."""
        t, e, h = micro_batch * self.tokens, self.weight_bytes, self.hidden
        n_cap = micro_batch * self.captions
        text = n_cap * self.text_len
        n = e * t * self.patch_dim + 4 * t * self.head_dim  # patches, cos / sin (fp32)
        n += e * text * self.text_dim + 3 * e * text * h  # caption in, GELU in / out, out
        return n + e * n_cap * (self.freq_dim + 9 * h)  # time embedder, time_proj

    def stage_saved(
        self, stage: int, micro_batch: int, recompute: str, full_layers: int | None = None
    ) -> int:
        """The blocks' saved bytes (``full_layers``: with selective or full recompute, only
        the first that many blocks recompute) and what the parts before them save."""
        redo = self.layers if full_layers is None else min(full_layers, self.layers)
        if recompute == "none":
            redo = 0
        n = redo * self.block_saved(micro_batch, recompute)
        n += (self.layers - redo) * self.block_saved(micro_batch, "none")
        return n + self.outside_saved(micro_batch)

    def stage_tail(self, stage: int, micro_batch: int) -> tuple[int, int]:
        """(saved, transient): the final adaLN and output projection with the fp32
        prediction; the loss's fp32 difference."""
        t, e, h = micro_batch * self.tokens, self.weight_bytes, self.hidden
        saved = 2 * e * t * h + 8 * t + 4 * t * self.out_patch_dim
        return saved, 8 * t * self.out_patch_dim

    def backward_workspace(self, micro_batch: int, recompute: str) -> int:
        """The gradients of a block's widest activations, plus a recomputed block's own."""
        t, e = micro_batch * self.tokens, self.weight_bytes
        n = 2 * e * t * self.hidden + e * t * self.ffn // self.tensor_parallel
        if recompute != "none":
            n += self.block_saved(micro_batch, "none")
        return n

    def batch_bytes(self, micro_batch: int) -> int:
        """Latents, noise and target per token, the captions (``input_bytes`` each)."""
        t = micro_batch * self.tokens
        text = micro_batch * self.captions * self.text_len
        return self.input_bytes * (3 * t * self.patch_dim + text * self.text_dim)


def wan_shapes(
    cfg: Any,
    *,
    tokens: int,
    captions: int,
    text_len: int,
    precision: str,
    tensor_parallel: int = 1,
    context_parallel: int = 1,
) -> WanShapes:
    """``WanShapes`` of a ``WanConfig`` at ``tokens`` tokens and ``captions`` captions of
    ``text_len`` tokens a micro-batch unit, on a rank of ``tensor_parallel`` x
    ``context_parallel``."""
    return WanShapes(
        hidden=cfg.hidden_size, ffn=cfg.ffn_dim, layers=cfg.num_layers,
        heads=cfg.num_attention_heads, head_dim=cfg.attention_head_dim,
        patch_dim=cfg.patch_dim, out_patch_dim=cfg.out_patch_dim, text_dim=cfg.text_dim,
        freq_dim=cfg.freq_dim, tokens=-(-tokens // context_parallel), captions=captions,
        text_len=text_len, cross_attn_norm=cfg.cross_attn_norm,
        tensor_parallel=tensor_parallel, weight_bytes=4 if precision == "fp32" else 2,
    )  # fmt: skip


def plan_diffusion_memory(run: Any) -> Any:
    """The memory plan of ``run`` (a ``DiffusionTraining`` whose data and parallel layout
    are open; ``train.memory_budget``), its ``train.recompute`` (and, split, the micro-batch)
    written back. A str (the plan's line) for a family without an estimate."""
    from longboat.core.megatron.engine.memory_plan import OptimizerPlan
    from longboat.core.megatron.engine.memory_shapes import plan_megatron_run, unplanned
    from longboat.core.megatron.engine.moments import moment_plan_fields
    from longboat.diffusion.models.wan.config import WanConfig

    cfg, t, m, lay = run.cfg, run.cfg.train, run.model_cfg, run.layout
    if not isinstance(m, WanConfig):
        return unplanned(t, f"the {run.family.name} family has no estimate")
    train = run.data.train
    dataset = train.dataset
    lengths = dataset.lengths(m.latent_patch)
    text_len = int(dataset.text_lengths.max()) if len(dataset.text_lengths) else 1
    if train.packed:  # a micro-batch is one pack of at most data.max_tokens tokens
        tokens = int(cfg.data.max_tokens)
        captions = max(1, tokens // max(1, int(lengths.min())))
        per_unit = 1
    else:
        tokens, captions, per_unit = int(lengths.max()), 1, 1
    shapes = wan_shapes(m, tokens=tokens * per_unit, captions=captions, text_len=text_len,
                        precision=run.precision, tensor_parallel=lay.tensor_parallel,
                        context_parallel=lay.context_parallel)  # fmt: skip
    opt = OptimizerPlan(
        data_parallel=lay.data_parallel,
        precision=run.precision,
        optimizer=cfg.optim.name,
        trainable_fraction=0.0 if cfg.lora.enabled else 1.0,
        context_parallel=lay.context_parallel,
        average_weights=bool(cfg.ema.enabled),
        **moment_plan_fields(cfg),
    )
    return plan_megatron_run(t, shapes, opt, run.accelerator, data_parallel=lay.data_parallel,
                             micro_batch_pinned=train.packed or t.cuda_graph is True,
                             layers_mode="selective", optim=cfg.optim)  # fmt: skip


__all__ = ["WanShapes", "plan_diffusion_memory", "wan_shapes"]

"""The megatron backend's memory plan: a decoder's peak on one rank from its shapes, and the
choice of ``train.recompute`` and the micro-batch split that fits ``train.memory_budget``.

Nothing is built or run: every byte comes from the architecture (``DecoderShapes``, made by
``DecoderShapes.of`` from a ``DecoderModelConfig``, the parallel layout and the run's
sequence length), as the megatron engine lays it out:

- weights: the exact parameter count of this rank's model chunk (embedding on the first
  pipeline stage, output layer and final norm on the last; attention and MLP sharded by
  tensor parallelism, routed experts by expert parallelism), in the weights' dtype;
- gradients: megatron DDP's grad buffer, fp32 or (single-pass bf16 gradients,
  ``core.megatron.wgrad_fusion.grad_plan``) bf16; the buffer's bucket padding (at most a few
  hundred elements) is not counted;
- optimizer state: the distributed optimizer's fp32 main weights (for bf16 / fp16 weights)
  and AdamW's two moments, fp32 or (``optim.moment_dtype=bf16``) bf16, sharded over the
  data-parallel ranks;
- activations: what each transformer layer saves for its backward with the longboat layer
  kernels (fused RMSNorm, add + RMSNorm, SwiGLU, QKV + RoPE, flash attention), for recompute
  none, selective (megatron's: the core attention, which then keeps its inputs but not its
  log-sum-exp) and full (each layer keeps only its input), times the microbatches 1F1B holds
  on the first stage; the LM head's: fused linear cross-entropy keeps the hidden and weight
  gradients it computes in the forward plus one transient logits chunk, the logits path an
  fp32 copy of the ``[tokens, vocab]`` logits;
- the backward's working set (the gradients flowing through one layer, plus a recomputed
  layer's activations under full recompute) or the LM head's transient, whichever is larger;
- a fixed allowance, ``ALLOCATOR_ALLOWANCE``, for what no shape gives: the caching
  allocator's fragmentation and the library workspaces (cuBLAS, NCCL). The CUDA context
  itself is outside the budget (``auto`` reads the free memory after it exists).

``choose_decoder_plan`` takes the first choice that fits, in core's order
(``engine.memory.plan``): recompute none, selective, full, then smaller micro-batches (the
same global batch in more accumulated microbatches) with the last mode; only where none of
those fits and the run allows it (``OptimizerPlan.allow_bf16_moments``), the same again with
bf16 moments, which change numerics (the plan's line says so); pinned levers stay as set,
and a run whose pinned levers cannot fit raises a ``ConfigError`` with the numbers. Without
a budget (``auto`` on a device that reports no memory) the pinned or default levers are kept
and only reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from longboat.core.config.errors import ConfigError, ConfigProblem
from longboat.core.engine.memory.budget import GB, format_bytes
from longboat.core.engine.memory.plan import (
    RECOMPUTE_ORDER,
    MemoryPlan,
    PeakEstimate,
    Pins,
    PlanChoice,
    candidate_choices,
    chosen_keys,
    micro_batch_options,
    storage_levels,
)
from longboat.core.engine.memory.states import OptimizerLayout, StateBytes

ALLOCATOR_ALLOWANCE = int(0.5 * GB)
"""Bytes every plan adds for the caching allocator's fragmentation and library workspaces
(cuBLAS, NCCL buffers): no shape predicts them."""

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class DecoderShapes:
    """A decoder's shapes on one rank, as the memory plan needs them (module doc)."""

    hidden: int
    """Model width."""
    ffn: int
    """Dense SwiGLU width."""
    layers: int
    """Decoder layers of the whole model."""
    heads: int
    """Query heads."""
    query_groups: int
    """Key / value heads."""
    head_dim: int
    """Per-head width."""
    vocab: int
    """Embedding rows."""
    seq_len: int
    """Tokens of one sample (a packed row)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys."""
    attention_bias: bool = False
    """Bias on the q / k / v projection."""
    tie_embeddings: bool = False
    """The output layer shares the input embedding."""
    experts: int = 0
    """Routed experts per layer (0: dense)."""
    expert_ffn: int = 0
    """Per-expert SwiGLU width."""
    topk: int = 0
    """Experts per token."""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    sequence_parallel: bool = False
    """Residual-stream tensors sharded over the tensor-parallel ranks."""
    weight_bytes: int = 2
    """Bytes of a weight (and of an activation: the weights' dtype)."""
    fused_ce: bool = True
    """The loss through fused linear cross-entropy (else megatron's logits)."""
    fused_qkv_rope: bool = True
    """q / k / v split and rotated by longboat's fused kernel; False: megatron's rotary (a
    VLM decoder's M-RoPE), where v stays a view of the qkv projection's output and each
    rotation keeps its own cos / sin."""

    @classmethod
    def of(
        cls,
        cfg: Any,
        *,
        seq_len: int,
        precision: str,
        layout: Any = None,
        fused_ce: bool = True,
        sequence_parallel: bool = False,
        fused_qkv_rope: bool = True,
    ) -> DecoderShapes:
        """The shapes of ``cfg`` (a ``DecoderModelConfig``) at ``seq_len`` tokens a sample, in
        ``precision`` (the weights' dtype: fp32 / bf16 / fp16), under ``layout`` (a megatron
        parallel layout; None: one rank). ``fused_ce``: the loss path (a tensor-, sequence- or
        context-parallel run takes the logits path whatever is asked); ``fused_qkv_rope``:
        the layers rotate q / k with longboat's fused kernel (False: megatron's rotary)."""
        tp = getattr(layout, "tensor_parallel", 1)
        cp = getattr(layout, "context_parallel", 1)
        fused = fused_ce and tp == 1 and cp == 1 and not sequence_parallel
        return cls(
            hidden=cfg.hidden_size,
            ffn=cfg.ffn_hidden_size,
            layers=cfg.num_layers,
            heads=cfg.num_attention_heads,
            query_groups=cfg.num_query_groups,
            head_dim=cfg.head_dim,
            vocab=cfg.vocab_size,
            seq_len=seq_len,
            qk_norm=bool(cfg.qk_norm),
            attention_bias=bool(cfg.attention_bias),
            tie_embeddings=bool(cfg.tie_embeddings),
            experts=cfg.num_experts,
            expert_ffn=cfg.moe_ffn_hidden_size or 0,
            topk=cfg.moe_topk if cfg.num_experts else 0,
            tensor_parallel=tp,
            pipeline_parallel=getattr(layout, "pipeline_parallel", 1),
            expert_parallel=getattr(layout, "expert_parallel", 1),
            context_parallel=cp,
            sequence_parallel=sequence_parallel,
            weight_bytes=_DTYPE_BYTES[precision],
            fused_ce=fused,
            fused_qkv_rope=fused_qkv_rope,
        )

    # --- parameters ---------------------------------------------------------------------

    def layer_params(self) -> int:
        """Parameters of one decoder layer on this rank."""
        h, d, tp = self.hidden, self.head_dim, self.tensor_parallel
        qkv = (self.heads + 2 * self.query_groups) * d // tp
        n = h + qkv * h + (qkv if self.attention_bias else 0)  # input norm, qkv
        n += 2 * d if self.qk_norm else 0
        n += self.heads * d // tp * h + h  # output projection, pre-MLP norm
        if self.experts:
            local = self.experts // self.expert_parallel
            n += self.experts * h + local * 3 * self.expert_ffn * h  # router, experts
        else:
            n += 3 * self.ffn // tp * h
        return n

    def stage_params(self, stage: int = 0) -> int:
        """Parameters of pipeline stage ``stage``'s chunk on one rank."""
        pp = self.pipeline_parallel
        first, last = stage == 0, stage == pp - 1
        embedding = self.vocab // self.tensor_parallel * self.hidden
        n = self.layers // pp * self.layer_params()
        n += embedding if first else 0
        if last:
            n += self.hidden  # final norm
            # tied: the last stage keeps its own copy of the embedding (pipeline > 1)
            n += embedding if not (self.tie_embeddings and first) else 0
        return n

    # --- activations --------------------------------------------------------------------

    def _tokens(self, micro_batch: int) -> int:
        return micro_batch * self.seq_len // self.context_parallel

    def layer_saved(self, micro_batch: int, recompute: str) -> int:
        """Bytes one layer saves for its backward at ``micro_batch`` samples (module doc)."""
        t, e, h, tp = (
            self._tokens(micro_batch),
            self.weight_bytes,
            self.hidden,
            self.tensor_parallel,
        )
        stream = e * t * h // (tp if self.sequence_parallel else 1)  # a residual-stream tensor
        if recompute == "full":
            return stream
        a, g, d = self.heads // tp, self.query_groups // tp, self.head_dim
        rows = t // (tp if self.sequence_parallel else 1)
        n = 2 * stream + 2 * 4 * rows  # norm input + rstd, add + norm sum + rstd
        n += 2 * e * t * h  # the normed inputs of the qkv and fc1 / router linears
        if self.fused_qkv_rope:
            n += 4 * self.seq_len * d  # rotary cos / sin tables (fp32)
        else:  # the qkv output v is a view of, and cos / sin of the q and k rotations
            n += e * t * (a + 2 * g) * d + 4 * e * t * d
        n += e * t * (2 * a + 2 * g) * d  # q, k, v and the attention output
        if recompute != "selective":
            n += 4 * t * a  # the attention's log-sum-exp
        if self.qk_norm:  # the normed q's input and rstd, the qkv output the k norm reads
            # (v stays a view of it) and the k norm's rstd
            n += e * t * (2 * a + g) * d + 4 * t * (a + g)
        if self.experts:  # routing maps and probabilities, the dispatched tokens in and
            # out of the experts, the experts' gate and up projections
            k, f = self.topk, self.expert_ffn
            n += 48 * t * k + 2 * e * t * k * (h + f)
        else:
            n += e * t * 3 * self.ffn // tp  # fc1 output (gate, up), fc2 input
        return n

    def head_saved(self, micro_batch: int) -> int:
        """Bytes the final norm and the LM loss save (last stage)."""
        t, e, h = self._tokens(micro_batch), self.weight_bytes, self.hidden
        n = e * t * h + 4 * t  # final norm
        if self.fused_ce:  # the gradients, computed in the forward
            return n + e * t * h + self.weight_bytes * self.vocab * h
        v = self.vocab // self.tensor_parallel
        return n + e * t * h + 4 * t * v + 9 * t  # output input, fp32 softmax, mask, target

    def head_transient(self, micro_batch: int) -> int:
        """The LM loss's transient buffers: one logits chunk (fused), or the low-precision
        logits beside their fp32 copy (logits path)."""
        t, v = self._tokens(micro_batch), self.vocab // self.tensor_parallel
        if self.fused_ce:
            rows = max(1, (1 << 30) // max(1, v * self.weight_bytes))
            chunk = min(t, max(1 << (rows.bit_length() - 1), 16))
            return chunk * v * self.weight_bytes
        return self.weight_bytes * t * v

    def backward_workspace(self, micro_batch: int, recompute: str) -> int:
        """The backward's working set inside one layer: the gradients of its largest
        activations, plus (full recompute) the layer's own activations brought back."""
        t, e = self._tokens(micro_batch), self.weight_bytes
        tp = self.tensor_parallel
        width = (
            self.topk * (3 * self.expert_ffn + self.hidden) if self.experts else 3 * self.ffn // tp
        )
        n = 2 * e * t * self.hidden + e * t * width
        if recompute == "full":
            n += self.layer_saved(micro_batch, "none")
        return n

    def batch_bytes(self, micro_batch: int) -> int:
        """A microbatch on the device: tokens, labels, positions (int64), loss mask (fp32)."""
        return 28 * micro_batch * self.seq_len

    # --- the estimator's view (``StagedShapes``) ------------------------------------------

    def stage_fp32_params(self, stage: int = 0) -> int:
        """None: a decoder's parameters all take the weights' dtype."""
        return 0

    def stage_saved(
        self, stage: int, micro_batch: int, recompute: str, full_layers: int | None = None
    ) -> int:
        """Bytes one in-flight microbatch keeps on pipeline stage ``stage``: its layers'
        saved activations (with full recompute and ``full_layers``, only the first that many
        layers recompute) and, recomputing, the rotary table they share."""
        layers = self.layers // self.pipeline_parallel
        redo = layers if recompute != "full" or full_layers is None else min(full_layers, layers)
        n = redo * self.layer_saved(micro_batch, recompute)
        n += (layers - redo) * self.layer_saved(micro_batch, "none")
        if recompute == "full":
            n += 4 * self.seq_len * self.head_dim  # the rotary table
        return n

    def stage_tail(self, stage: int, micro_batch: int) -> tuple[int, int]:
        """(saved, transient) bytes of what follows the layers on ``stage``: the LM head and
        loss on the last stage, nothing elsewhere."""
        if stage != self.pipeline_parallel - 1:
            return 0, 0
        return self.head_saved(micro_batch), self.head_transient(micro_batch)


@dataclass(frozen=True, kw_only=True)
class OptimizerPlan:
    """How the megatron engine stores the trainable state (module doc)."""

    data_parallel: int = 1
    """Ranks the distributed optimizer shards its state over."""
    precision: str = "bf16"
    """The weights' dtype."""
    optimizer: str = "adamw"
    """``optim.name``: adamw keeps two moments, sgd (no momentum) none."""
    trainable_fraction: float = 1.0
    """Share of the parameters that train (LoRA: the adapters' share); the rest are frozen."""
    bf16_grads_single_pass: bool = True
    """bf16 grads where a step takes one microbatch (``wgrad_fusion.grad_plan``)."""
    context_parallel: int = 1
    """Context-parallel ranks (their gradient reduction keeps the grad buffer fp32)."""
    average_weights: bool = False
    """An fp32 average of the trainable weights is kept (``ema.enabled``)."""
    moment_bytes: int = 4
    """Bytes of an AdamW moment element: 4 (fp32), 2 (``optim.moment_dtype=bf16``). A
    choice's own ``PlanChoice.moment_bytes`` replaces it in that choice's estimate."""
    moments_pinned: bool = False
    """``optim.moment_dtype`` is set: the plan keeps ``moment_bytes``."""
    allow_bf16_moments: bool = False
    """The plan may choose bf16 moments where nothing else fits (``optim.moment_dtype``
    null and every step through the one-pass update: ``engine.moments``); they change
    numerics."""


def grad_bytes(opt: OptimizerPlan, microbatches: int, pipeline_parallel: int = 1) -> int:
    """Bytes of one gradient element in megatron's grad buffer for a step of
    ``microbatches`` (``core.megatron.wgrad_fusion.grad_plan``)."""
    from longboat.core.megatron.wgrad_fusion import grad_plan

    if opt.precision == "bf16" and not opt.bf16_grads_single_pass:
        return 4
    _fusion, fp32 = grad_plan(precision=opt.precision, microbatches=microbatches,
                              data_parallel=opt.data_parallel,
                              context_parallel=opt.context_parallel,
                              pipeline_parallel=pipeline_parallel)  # fmt: skip
    return 4 if fp32 else _DTYPE_BYTES[opt.precision]


def decoder_state_bytes(
    params: int,
    opt: OptimizerPlan,
    *,
    microbatches: int,
    pipeline_parallel: int = 1,
    fp32_params: int = 0,
) -> StateBytes:
    """Exact bytes of one rank's weights, grad buffer, main weights and moments for
    ``params`` parameters (module doc), ``fp32_params`` of them kept in fp32 whatever the
    precision (norm weights a model keeps so); ``opt.average_weights`` adds an fp32 copy
    of the trainable weights."""
    w = _DTYPE_BYTES[opt.precision]
    trainable = round(params * opt.trainable_fraction)
    frozen = params - trainable
    dp = opt.data_parallel
    shard = -(-trainable // dp)
    masters = 4 * shard if opt.precision != "fp32" else 0
    moments = 2 * opt.moment_bytes * shard if opt.optimizer == "adamw" else 0
    fp32 = min(fp32_params, trainable)  # their grads are fp32 too (megatron's buffers)
    g = grad_bytes(opt, microbatches, pipeline_parallel)
    return StateBytes(
        weights=w * trainable + (4 - w) * fp32,
        grads=g * trainable + (4 - g) * fp32,
        masters=masters,
        moments=moments,
        frozen=w * frozen,
        extra=4 * trainable if opt.average_weights else 0,
        trainable_params=trainable,
        frozen_params=frozen,
    )


class StagedShapes(Protocol):
    """What the megatron memory plan reads of a model: the decoder's ``DecoderShapes``, a
    composition of it with encoders (``memory_shapes.ComposedShapes``: a VLM's vision tower),
    or a stack's own block model (a DiT's)."""

    pipeline_parallel: int

    def stage_params(self, stage: int = 0) -> int:
        """Parameters of pipeline stage ``stage`` on one rank."""
        ...

    def stage_fp32_params(self, stage: int = 0) -> int:
        """Of those, the parameters kept in fp32 whatever the precision."""
        ...

    def stage_saved(
        self, stage: int, micro_batch: int, recompute: str, full_layers: int | None = None
    ) -> int:
        """Bytes one in-flight microbatch keeps for the backward on ``stage``."""
        ...

    def stage_tail(self, stage: int, micro_batch: int) -> tuple[int, int]:
        """(saved once, transient) bytes of the head / loss on ``stage``."""
        ...

    def backward_workspace(self, micro_batch: int, recompute: str) -> int:
        """The backward's working set inside one block."""
        ...

    def batch_bytes(self, micro_batch: int) -> int:
        """A microbatch's inputs on the device."""
        ...


def estimate_stage_peak(
    shapes: StagedShapes,
    opt: OptimizerPlan,
    choice: PlanChoice,
    *,
    samples: int,
    full_layers: int | None = None,
) -> PeakEstimate:
    """The predicted peak of ``choice`` on the busiest pipeline stage of ``shapes``.
    ``samples``: the samples a step takes on one rank (micro-batch x microbatches; the
    accumulation follows from the choice's micro-batch); ``full_layers``: with full
    recompute, only the first that many layers of each stage recompute
    (``train.recompute_layers``). The moments take the choice's storage
    (``PlanChoice.moment_bytes``)."""
    if choice.moment_bytes != opt.moment_bytes:
        opt = dataclasses.replace(opt, moment_bytes=choice.moment_bytes)
    b, mode = choice.micro_batch, choice.recompute
    microbatches = max(1, samples // b)
    pp = shapes.pipeline_parallel
    best: PeakEstimate | None = None
    for stage in range(pp):
        states = decoder_state_bytes(shapes.stage_params(stage), opt,
                                     microbatches=microbatches, pipeline_parallel=pp,
                                     fp32_params=shapes.stage_fp32_params(stage))  # fmt: skip
        in_flight = min(pp - stage, microbatches)  # 1F1B's warm-up on this stage
        saved = in_flight * shapes.stage_saved(stage, b, mode, full_layers)
        tail, transient = shapes.stage_tail(stage, b)
        workspace = max(shapes.backward_workspace(b, mode), transient)
        est = PeakEstimate(states, saved + tail, workspace, in_flight * shapes.batch_bytes(b),
                           allowance=ALLOCATOR_ALLOWANCE)  # fmt: skip
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


estimate_decoder_peak = estimate_stage_peak
"""The decoder's name for ``estimate_stage_peak``."""


def choose_decoder_plan(
    shapes: StagedShapes,
    opt: OptimizerPlan,
    *,
    micro_batch: int,
    accum: int,
    budget: float | None,
    budget_source: str,
    recompute: str | None = None,
    micro_batch_pinned: bool = False,
    recompute_modes: Sequence[str] = RECOMPUTE_ORDER,
    full_layers: int | None = None,
) -> MemoryPlan:
    """The run's plan (module doc). ``micro_batch`` / ``accum``: the run's micro-batch and
    this rank's microbatches a step as configured; ``recompute``: ``train.recompute`` as set
    (None: the plan chooses); ``micro_batch_pinned``: the micro-batch stays whole;
    ``full_layers``: ``train.recompute_layers`` (with full recompute). The moments'
    storage: ``opt.moment_bytes``, pinned or (``opt.allow_bf16_moments``) bf16 where
    nothing else fits, in core's candidate order (``engine.memory.plan``)."""
    samples = micro_batch * accum
    default = PlanChoice(recompute or "none", micro_batch, opt.moment_bytes)

    def est(c: PlanChoice) -> PeakEstimate:
        return estimate_stage_peak(shapes, opt, c, samples=samples, full_layers=full_layers)

    if budget is None:
        return MemoryPlan(default, est(default), None, budget_source)
    pinned = Pins(recompute=recompute, micro_batch=micro_batch_pinned,
                  moment_bytes=opt.moment_bytes if opt.moments_pinned else None)  # fmt: skip
    layout = OptimizerLayout(moment_bytes=opt.moment_bytes)
    bf16_moments = opt.allow_bf16_moments and opt.optimizer == "adamw"
    levels = storage_levels(layout, pinned, allow_bf16_moments=bf16_moments, allow_bf16_sr=False)
    candidates = candidate_choices(micro_batch, micro_batch_options(micro_batch), pinned,
                                   layout, levels, recompute_modes)  # fmt: skip
    options = tuple((c, est(c)) for c in candidates)
    for choice, e in options:
        if e.total <= budget:
            chosen = chosen_keys(choice, default, pinned)
            numerics = tuple(k for k in choice.storage_keys(layout) if k in chosen)
            return MemoryPlan(choice, e, budget, budget_source, chosen, numerics, options)
    best_choice, best = min(options, key=lambda ce: ce[1].total)
    pins = [f"train.recompute={recompute}"] if recompute is not None else []
    if micro_batch_pinned:
        pins.append(f"micro-batch {micro_batch} (one microbatch a step)")
    if opt.moments_pinned:
        pins.append(f"optim.moment_dtype={'bf16' if opt.moment_bytes == 2 else 'fp32'}")
    raise ConfigError(
        [
            ConfigProblem(
                key="train.memory_budget",
                message=(
                    f"the run does not fit {format_bytes(budget)} ({budget_source}; "
                    f"{', '.join(pins) or 'nothing pinned'}): the smallest plan, "
                    f"train.recompute={best_choice.recompute} at micro-batch "
                    f"{best_choice.micro_batch}"
                    + "".join(f", {k}" for k in best_choice.storage_keys(layout))
                    + f", needs {format_bytes(best.total)} ({best.breakdown()})"
                ),
                fix=(
                    "raise train.memory_budget"
                    + (", unset the pinned keys" if pins else "")
                    + ", or shard the model over more ranks (parallel.data_parallel for the "
                    "optimizer state, tensor_parallel / pipeline_parallel for the rest)"
                ),
            )
        ]
    )


def smallest_budget_over_ranks(budget: float | None, accelerator: Any) -> float | None:
    """The smallest budget of all ranks (every rank must choose the same micro-batch: an
    ``auto`` budget follows each device's free memory)."""
    import torch
    import torch.distributed as dist

    if budget is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return budget
    device = accelerator.device() if accelerator.device_type != "cpu" else "cpu"
    value = torch.tensor([budget], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return float(value.item())


__all__ = [
    "ALLOCATOR_ALLOWANCE",
    "DecoderShapes",
    "OptimizerPlan",
    "StagedShapes",
    "choose_decoder_plan",
    "decoder_state_bytes",
    "estimate_decoder_peak",
    "estimate_stage_peak",
    "grad_bytes",
    "plan_run_memory",
    "smallest_budget_over_ranks",
]


def plan_run_memory(
    train: Any,
    shapes: StagedShapes,
    opt: OptimizerPlan,
    accelerator: Any,
    *,
    accum: int,
    micro_batch_pinned: bool = False,
    recompute_modes: Sequence[str] = RECOMPUTE_ORDER,
    layers_mode: str = "full",
) -> MemoryPlan:
    """The plan of a run whose ``train`` section (``train.memory_budget``, ``recompute``,
    ``recompute_layers``, ``micro_batch_size``) is given, on ``accelerator``: the budget
    resolved (the smallest of all ranks), the levers the user set pinned (``recompute`` not
    null; ``recompute_layers`` pins ``layers_mode`` recompute of that many layers), then
    ``choose_decoder_plan``. ``accum``: this rank's microbatches a step as configured."""
    from longboat.core.engine.memory.budget import resolve_budget_bytes

    budget, source = resolve_budget_bytes(train.memory_budget, accelerator)
    budget = smallest_budget_over_ranks(budget, accelerator)
    layers = getattr(train, "recompute_layers", None)
    pinned = train.recompute or (layers_mode if layers is not None else None)
    return choose_decoder_plan(
        shapes,
        opt,
        micro_batch=int(train.micro_batch_size),
        accum=accum,
        budget=budget,
        budget_source=source,
        recompute=pinned,
        micro_batch_pinned=micro_batch_pinned,
        recompute_modes=recompute_modes,
        full_layers=layers,
    )

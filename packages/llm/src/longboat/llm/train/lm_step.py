"""The LLM's step on core's megatron step engine: model, DDP + optimizer, forward + loss.

``build_train_step`` builds the part of a run below the data: the longboat layer spec
(``build_model``: SDPA flash / cuDNN attention, Triton RMSNorm, SwiGLU and RoPE, weights
initialised on the device on CUDA), optional initial weights and LoRA adapters, megatron DDP +
distributed optimizer (core's ``engine.ddp.wrap_and_build``) with torch's fused AdamW, in bf16
weight-gradient GEMMs that accumulate into megatron's grad buffer
(``core.megatron.wgrad_fusion``), the loss through fused linear cross-entropy (``train.loss``)
wherever it applies, and the update (the engine's: megatron's step without the grad-norm host
read when clipping is off, or the one-pass AdamW update). ``longboat.llm.train.training.
build_training`` (what the command line and the benchmarks run) calls it with the values of
the run's config.

``TrainStep`` is a ``MegatronStepEngine`` whose ``forward_backward`` runs megatron's pipeline
schedules (``train.megatron_schedule``); the engine owns the update, the NaN gate and the
CUDA-graph step. ``TrainStep.step(tokens, labels)`` is one whole step on one microbatch and
reads nothing on the host. megatron's parallel state must be initialised first
(``longboat.core.megatron.parallel_state.initialize``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from longboat.core.config.schema import OptimConfig
from longboat.core.megatron.decoder_config import DecoderModelConfig
from longboat.core.megatron.engine import MegatronStepEngine
from longboat.core.megatron.parallel_state import current_layout
from longboat.core.megatron.wgrad_fusion import grad_plan, install_wgrad_fusion


@dataclass
class TrainStep(MegatronStepEngine):
    """A built training step (see the module docstring); call ``step`` once per batch."""

    chunks: list[torch.nn.Module]
    """The megatron model chunks (``GPTModel``) of this rank."""
    model: list[torch.nn.Module]
    """The chunks wrapped in megatron's ``DistributedDataParallel``."""
    optimizer: Any
    """megatron's (distributed, chained) optimizer."""
    device: torch.device
    fused_linear_ce: bool = True
    """Loss through fused linear cross-entropy where it applies (else megatron's logits)."""
    graph_ready: bool = False
    """Built with ``cuda_graph=True`` (DDP constructed under a side stream): ``graphed`` works."""
    one_pass: Any = None
    """Core's ``engine.one_pass_adamw.OnePassAdamW`` when the update runs as one pass per
    shard (set by ``use_one_pass``)."""
    one_pass_blocker: str | None = None
    """Why the one-pass update was asked for (``"auto"``) but does not apply, if so."""
    aux_loss_notice: str | None = None
    """Why ``model.moe_aux_loss=auto`` trains with megatron's term here, if so."""
    experts_notice: str | None = None
    """Why ``model.moe_experts=auto`` runs megatron's per-expert loop here, if so."""
    lora_notice: str | None = None
    """What a LoRA run keeps frozen beyond the weights (DeepSeek-V3's expert bias), if so."""
    objective: Any = None
    """A ``train.megatron_schedule.StepObjective`` replacing the LM loss (e.g. DPO's), or
    None for next-token cross-entropy."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Extra 0-d device scalars of the last ``forward_backward`` (``moe_aux_loss``: the
    step's mean MoE load-balancing loss as transformers reports it, with
    ``model.moe_aux_loss=hf``)."""
    _positions: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def batch(
        self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor | None]:
        """One microbatch in the loop's format (positions ``0..s-1``, causal attention;
        ``loss_mask=None``: every token counts)."""
        b, s = tokens.shape
        if (b, s) not in self._positions:
            pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, -1)
            self._positions[(b, s)] = pos
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": self._positions[(b, s)],
            "attention_mask": None,
        }

    def forward_backward(self, microbatches: list[dict[str, Any]]) -> torch.Tensor:
        """Zero the grads, forward + backward over ``microbatches`` (megatron's schedule),
        reduce the grads; the step's mean loss as a 0-d device tensor (no host sync)."""
        from longboat.llm.train.megatron_schedule import forward_backward

        self.optimizer.zero_grad()
        self.metrics = {}
        return forward_backward(
            self.model,
            microbatches,
            self.device,
            fused_ce=self.fused_linear_ce,
            metrics=self.metrics,
            objective=self.objective,
        )

    def graph_modules(self) -> Any:
        return (m for chunk in self.chunks for m in chunk.modules())

    def step(
        self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One optimizer step on ``tokens`` / ``labels`` ``[b, s]`` (labels already shifted).

        Returns the mean token loss as a 0-d device tensor (no host sync).
        """
        loss = self.forward_backward([self.batch(tokens, labels, loss_mask)])
        self.update()
        return loss

    __call__ = step

    def graphed(self, accelerator: Any, *, warmup: int = 3) -> Any:
        """``step`` replayed as one CUDA graph after ``warmup`` eager steps (core's
        ``GraphedStep``; eager where the accelerator has no graphs). Every call must use the
        same shapes (``loss_mask`` not supported); returns the loss as a fresh 0-d tensor.
        Needs ``build_train_step(..., cuda_graph=True)``. The inner AdamW becomes capturable
        with its LR in a device tensor (``core.megatron.optimizer.capturable_torch_adamw``):
        build an LR scheduler before calling this, so its updates are in-place fills."""
        if not self.graph_ready:
            raise ValueError(
                "TrainStep.graphed needs a step built with build_train_step(..., "
                "cuda_graph=True): megatron's DDP must be constructed under a side stream "
                "for its backward to be capturable"
            )
        from longboat.core.loop import GraphedStep
        from longboat.core.megatron.optimizer import capturable_torch_adamw

        capturable_torch_adamw(self.optimizer)
        graph = GraphedStep(
            lambda b: self.step(b["tokens"], b["labels"]),
            accelerator=accelerator,
            warmup=warmup,
            name="llm train step",
        )

        def run(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return graph({"tokens": tokens, "labels": labels}).clone()

        run.graph = graph  # type: ignore[attr-defined]
        return run


def build_train_step(
    model_cfg: DecoderModelConfig,
    optim: OptimConfig,
    *,
    precision: str = "bf16",
    device: torch.device | str | None = None,
    microbatches: int = 1,
    fused_linear_ce: bool = True,
    wgrad_fusion: bool = True,
    compile_layers: bool = False,
    init_weights: Any = None,
    exact_main_weights: bool = False,
    lora: Any = None,
    seed: int = 0,
    cuda_graph: bool = False,
    one_pass_adamw: bool | str = False,
    kernel_options: dict[str, Any] | None = None,
    objective: Any = None,
    fp8_recipe: str | None = None,
    **model_overrides: Any,
) -> TrainStep:
    """Build the model, megatron DDP + optimizer and the step ``longboat-llm train`` runs.

    ``device``: where the model lives (default: the accelerator's device).
    ``microbatches``: gradient-accumulation microbatches per step (the grad buffer's dtype
    depends on it). ``fused_linear_ce`` / ``wgrad_fusion``: as ``llm.fused_linear_ce`` /
    ``llm.wgrad_fusion``. ``compile_layers``: ``torch.compile`` each decoder layer (what
    ``train.compile`` does).
    ``init_weights``: called with the model chunks after they are built and before the
    optimizer copies them into its fp32 main weights (e.g. ``lambda c: load_hf(c, cfg, dir)``);
    loading weights after ``build_train_step`` would leave the main weights at the random init.
    ``exact_main_weights`` (with ``init_weights``, bf16 / fp16): the optimizer's fp32 main
    weights start from the exact values ``init_weights`` writes into an fp32 copy of the model
    (built for the purpose, then freed), not from the bf16 model weights. For an fp32
    checkpoint this matters: started on the bf16 grid, small early updates (an LR warm-up's
    first steps are below bf16 resolution) round back to where they were, while fp32-weight
    training applies them. Costs an fp32 copy of the model at build time.
    ``lora``: a ``LoRAConfig`` whose adapters go on the linears after ``init_weights``
    (initialised from ``seed``); only they train.
    ``cuda_graph``: build for ``TrainStep.graphed`` and the engine's CUDA-graph step
    (megatron's DDP constructed under a side stream: see core's ``engine.ddp.wrap_and_build``).
    ``one_pass_adamw``: the update as one kernel pass per parameter shard (core's
    ``engine.one_pass_adamw``, ``MegatronStepEngine.use_one_pass``); True requires it (an
    error where the optimizer cannot take it), ``"auto"`` (what ``optim.one_pass_adamw=true``
    means) uses it where it applies and records why not in ``TrainStep.one_pass_blocker``.
    ``optim.moment_dtype=bf16``: the one-pass update keeps the moments in bf16 (a
    ``ConfigError`` where it does not take every step: core's ``engine.moments``).
    ``kernel_options``: ``build_model``'s switches of the longboat layer kernels (tests).
    ``objective``: a ``train.megatron_schedule.StepObjective`` replacing the LM loss (DPO).
    ``fp8_recipe``: run the decoder layers' linears in FP8 with this recipe
    (``train.fp8.recipe`` of a ``train.precision=fp8`` run; ``precision`` is then the weights'
    dtype, bf16); on a device without FP8 matmuls the GEMMs are emulated (tests only: the
    command line refuses such a device, ``check_precision_hardware``).
    ``model_overrides`` go to megatron's ``TransformerConfig`` (as in ``build_model``).
    """
    from longboat.core.config.errors import ConfigError
    from longboat.core.megatron.engine import ddp
    from longboat.core.megatron.lora import apply_lora
    from longboat.kernels import adamw_master_step_
    from longboat.llm.build import aux_loss_layout, build_model
    from longboat.llm.moe_aux_loss import check_pooled_aux_loss, pooled_aux_loss_notice
    from longboat.llm.moe_experts import moe_experts_for_run
    from longboat.llm.validate import lora_frozen_base, lora_target_problems

    if device is None:
        from longboat.core.device import get_accelerator

        device = get_accelerator().device()
    device = torch.device(device)
    layout = current_layout()
    if layout is None:
        raise RuntimeError(
            "build_train_step needs megatron's parallel state: call "
            "longboat.core.megatron.parallel_state.initialize(parallel, accelerator) first."
        )
    # Not under torch.compile: it would have to trace megatron's in-place buffer write in
    # the linears' backward (an attribute tensor on ctx), so the compiled path keeps the hook.
    fusion, fp32_grads = (False, True)
    if wgrad_fusion and not compile_layers:
        fusion, fp32_grads = grad_plan(
            precision=precision,
            microbatches=microbatches,
            data_parallel=layout.data_parallel,
            context_parallel=layout.context_parallel,
            pipeline_parallel=layout.pipeline_parallel,
        )
    model_overrides.setdefault("gradient_accumulation_fusion", fusion)
    if model_overrides["gradient_accumulation_fusion"]:
        install_wgrad_fusion()  # megatron's apex extension, in torch
    # Before the model is built: transformers' pooled load-balancing loss must apply here.
    aux_layout = aux_loss_layout(model_overrides)
    check_pooled_aux_loss(model_cfg, **aux_layout)
    aux_notice = pooled_aux_loss_notice(model_cfg, **aux_layout)
    lora_notice = None
    if lora is not None:
        if bad := lora_target_problems(model_cfg, list(lora.targets)):
            raise ConfigError(bad)
        model_cfg, lora_notice = lora_frozen_base(model_cfg)
    model_cfg, experts_notice = moe_experts_for_run(model_cfg, lora)
    if fp8_recipe is not None:
        check_fp8_backend(model_cfg, device.type)
        kernel_options = {**(kernel_options or {}), "fp8": fp8_recipe}
    chunks = build_model(
        model_cfg,
        precision=precision,
        device_type=device.type,
        kernel_options=kernel_options,
        **model_overrides,
    )
    if init_weights is not None:
        init_weights(chunks)
    if lora is not None:
        apply_lora(chunks, rank=lora.rank, alpha=lora.alpha, targets=list(lora.targets), seed=seed)
        if getattr(lora, "init_from", None):
            from longboat.llm.peft import load_peft

            load_peft(chunks, model_cfg, lora.init_from)
    if compile_layers:
        compile_decoder_layers(chunks)
    model, optimizer = ddp.wrap_and_build(
        chunks, optim, precision=precision, grad_reduce_in_fp32=fp32_grads, side_stream=cuda_graph
    )
    if exact_main_weights and init_weights is not None and precision in ("bf16", "fp16"):
        main_weights_from_fp32_init(
            optimizer, chunks, model_cfg, device, init_weights, model_overrides
        )
    step = TrainStep(
        chunks=chunks,
        model=model,
        optimizer=optimizer,
        device=device,
        fused_linear_ce=fused_linear_ce,
        graph_ready=cuda_graph,
        aux_loss_notice=aux_notice,
        experts_notice=experts_notice,
        lora_notice=lora_notice,
        objective=objective,
    )
    step.use_one_pass(one_pass_adamw, adamw_master_step_, getattr(optim, "moment_dtype", None))
    return step


def check_fp8_backend(model_cfg: DecoderModelConfig, device_type: str) -> None:
    """``ConfigError`` where the run's layer spec has no longboat FP8 linears (core's
    ``specs.check_fp8_layer_backend``)."""
    from longboat.core.megatron.specs import check_fp8_layer_backend

    check_fp8_layer_backend(model_cfg.layer_backend, device_type)


def wants_exact_main_weights(hf_dir: Any, precision: str, lora: bool) -> bool:
    """Whether training from ``hf_dir`` should start the main weights from its exact values:
    full fine-tuning (LoRA's frozen base has no main weights) in bf16 / fp16 from a checkpoint
    with fp32 tensors (``core.megatron.optimizer.checkpoint_above_precision``)."""
    from longboat.core.megatron.optimizer import checkpoint_above_precision

    return not lora and checkpoint_above_precision(hf_dir, precision)


def main_weights_from_fp32_init(
    optimizer: Any,
    chunks: list[torch.nn.Module],
    model_cfg: Any,
    device: torch.device,
    init_weights: Any,
    overrides: dict,
) -> None:
    """Run ``init_weights`` on an fp32 copy of the model and start megatron's main weights of
    ``chunks`` from it (``core.megatron.optimizer.start_main_weights``; ValueError without
    megatron's distributed optimizer)."""
    from longboat.core.megatron.optimizer import start_main_weights
    from longboat.llm.build import build_model

    shadow = build_model(model_cfg, precision="fp32", device_type=device.type, **overrides)
    init_weights(shadow)
    try:
        for chunk, fp32 in zip(chunks, shadow, strict=True):
            start_main_weights(
                optimizer, chunk, {n: p.detach() for n, p in fp32.named_parameters()}
            )
    finally:
        del shadow


def compile_decoder_layers(chunks: list[torch.nn.Module]) -> int:
    """``torch.compile`` every decoder layer in place; returns how many were compiled.

    Per layer rather than the whole model: megatron's model-level code (schedules, DDP
    hooks, the embedding and the fused loss) stays eager, and all layers share one graph.
    """
    n = 0
    for chunk in chunks:
        decoder = getattr(chunk, "decoder", None)
        for layer in getattr(decoder, "layers", []):
            layer.compile()
            n += 1
    return n

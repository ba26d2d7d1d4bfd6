"""The LLM baselines: Hugging Face transformers Llama as the HF Trainer trains it, and upstream
megatron-core ``GPTModel`` with megatron's own local layer spec.

Both read the model shape and optimizer settings from the composed longboat config (``cfg.model``,
a ``DecoderModelConfig``; ``cfg.optim``), so every run trains the same shapes with the same
hyperparameters; nothing else of longboat is used except ``longboat.core.megatron.parallel_state``
for megatron's process groups.

``HFStep`` (``hf_eager``, ``hf_compiled``, ``hf_liger``): ``LlamaForCausalLM`` (``Qwen3`` /
``Qwen3Moe`` for those families; SDPA, random init with ``initializer_range = model.init_std``),
fp32 weights under bf16 autocast (Trainer ``bf16=True``), ``torch.optim.AdamW(fused=True)``
decaying matrices only (the Trainer exempts biases and norms), ``clip_grad_norm_`` at
``optim.grad_clip`` (``max_grad_norm``); ``compiled``: the whole model ``torch.compile``d;
``liger``: ``apply_liger_kernel_to_llama`` / ``_qwen3`` (RoPE, RMSNorm, SwiGLU, fused linear
CE; dense models only). Qwen3-MoE: every layer sparse, ``output_router_logits=True`` so the
loss is cross-entropy + ``router_aux_loss_coef`` x the load-balancing loss, experts through
transformers' ``grouped_mm`` implementation (``hf_experts_kernel`` says which kernel that is).
How it differs from a user's HF Trainer run:

1. No ``Trainer`` object: its per-step host work (logging, callbacks) is left out, which only
   favours the baseline; ``loss.item()`` is not read every step (the Trainer reads it at logging
   steps).
2. The LR follows ``lr_factor`` (the product's warm-up + decay) when given (loss alignment), else
   it is constant (throughput: the scheduler adds no GPU work to the step).
3. The loss alignment passes ``shift_labels`` (the product's targets, -100 where its
   ``loss_mask`` is 0) instead of ``labels=input_ids``: the same positions and mean.
4. The loss alignment of an MoE shape in bf16 runs the MoE layers at the product's precision
   (``match_moe_precision``, llm_loss_alignment's ``--reference-moe-precision matched``, its
   default): autocast lowers every ``nn.Linear`` to bf16 but not transformers' grouped expert
   GEMMs, which then run on the fp32 weights, while it does lower the router's linear, whose
   logits and scores transformers means to be fp32. The product (megatron's bf16 modules)
   computes the experts in bf16 and the router's logits in fp32 from its bf16 weight and
   activations (``moe_router_dtype=fp32``). So the experts take bf16 copies of their fp32
   weights inside the forward (the gradient flows to the fp32 weights, as autocast does for a
   linear) and the router runs outside autocast on bf16-rounded operands. The throughput rows
   keep transformers as users run it.

``McoreStep`` (``mcore_local_spec``): ``GPTModel`` + ``get_gpt_layer_local_spec`` (no Transformer
Engine: unfused attention, torch norms), bf16 params, megatron DDP (fp32 grad buffer) and
``get_megatron_optimizer`` (fp32 main weights, clipping at ``optim.grad_clip``), the loss from
``GPTModel(labels=...)``. Differences from upstream: without TE / apex megatron falls back to
torch's AdamW with ``foreach``; its param groups are switched to ``fused=True`` (what TE's fused
Adam gives megatron users). The process groups come from ``parallel_state.initialize``
(megatron's ``initialize_model_parallel`` + ``model_parallel_cuda_manual_seed``, its per-call
TP-group lookup answered without the deprecation warning; on CPU megatron's ``torch.cuda`` calls
go to the host, since megatron has no CPU path).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .reference_adamw import ReferenceAdamW


def param_counts(m: Any) -> tuple[int, int]:
    """(every parameter, the parameters one token passes through) of the Llama / Qwen3 /
    Qwen3-MoE model ``m`` (a ``DecoderModelConfig``; equal for a dense model); a
    DeepSeek-V3 model's by its family's own count (latent attention, shared experts)."""
    if getattr(m, "kv_lora_rank", None) is not None:
        from longboat.llm.models.deepseek_v3.flops import param_counts as deepseek_counts

        return deepseek_counts(m)
    h, hd = m.hidden_size, m.head_dim
    attn = h * m.num_attention_heads * hd * 2 + 2 * h * m.num_query_groups * hd
    base = attn + 2 * h + (2 * hd if getattr(m, "qk_norm", False) else 0)
    emb = (1 if m.tie_embeddings else 2) * m.vocab_size * h + h
    experts = getattr(m, "num_experts", 0)
    if not experts:
        n = emb + m.num_layers * (base + 3 * h * m.ffn_hidden_size)
        return n, n
    expert = 3 * h * m.moe_ffn_hidden_size
    base += h * experts  # the router
    return (emb + m.num_layers * (base + experts * expert),
            emb + m.num_layers * (base + m.moe_topk * expert))  # fmt: skip


def param_count(m: Any) -> int:
    """Parameters of the model ``m`` (a ``DecoderModelConfig``)."""
    return param_counts(m)[0]


def flops_per_token(m: Any, seq: int) -> float:
    """Training FLOPs of one token of a ``seq``-token sequence, as the llm families count them
    (their ``Family.flops_per_sample`` is ``seq`` times this: 6 N + 6 L s d_attn, N the
    parameters a token passes through)."""
    from longboat.llm.models.family import flops_per_token as family_flops_per_token

    return family_flops_per_token(m, seq)


def lr_factor(schedule: Any, total_steps: int) -> Callable[[int], float]:
    """The multiplier of ``optim.lr`` at update ``s`` (``optim.schedule``: linear warm-up
    ``(s + 1) / W``, then constant / linear / cosine to ``min_lr_ratio`` over the rest)."""
    w, m, name = schedule.warmup_steps, schedule.min_lr_ratio, schedule.name
    decay = schedule.decay_steps or max(1, total_steps - w)
    if name not in ("constant", "linear", "cosine"):
        raise ValueError(f"optim.schedule.name={name}: the reference knows constant/linear/cosine")

    def f(s: int) -> float:
        if s < w:
            return (s + 1) / w
        p = min(1.0, (s - w) / decay)
        if name == "constant":
            return 1.0
        if name == "linear":
            return 1.0 - (1.0 - m) * p
        return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))

    return f


def hf_causal_lm(m: Any, device: torch.device) -> torch.nn.Module:
    """``LlamaForCausalLM`` (``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` for ``m.name``
    ``qwen3`` / ``qwen3_moe``: every layer sparse, the load-balancing loss in the training loss,
    the ``grouped_mm`` experts) with the shapes of ``m``, in train mode."""
    import transformers

    if m.name == "deepseek_v3":
        return hf_deepseek_v3(m, device)
    kind = {"llama3": "Llama", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}.get(m.name)
    if kind is None:
        raise ValueError(
            f"model.name={m.name}: the HF baseline knows llama3, qwen3, qwen3_moe, deepseek_v3"
        )
    config_cls = getattr(transformers, f"{kind}Config")
    model_cls = getattr(transformers, f"{kind}ForCausalLM")
    moe = {}
    if m.name == "qwen3_moe":  # every layer sparse; the aux loss in the training loss
        moe = dict(num_experts=m.num_experts, num_experts_per_tok=m.moe_topk,
                   moe_intermediate_size=m.moe_ffn_hidden_size, norm_topk_prob=m.moe_norm_topk_prob,
                   router_aux_loss_coef=m.moe_aux_loss_coeff, output_router_logits=True,
                   decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    cfg = config_cls(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        attention_bias=m.attention_bias,
        initializer_range=m.init_std,
        use_cache=False,
        **moe,
    )
    cfg._attn_implementation = "sdpa"
    if moe:  # transformers' fastest built-in experts: one grouped GEMM per projection
        cfg._experts_implementation = "grouped_mm"
    with device:
        model = model_cls(cfg)
    return model.train()


def hf_deepseek_v3(m: Any, device: torch.device) -> torch.nn.Module:
    """``DeepseekV3ForCausalLM`` (``DeepseekV32ForCausalLM`` with sparse attention) from the
    family's own export config of ``m``: SDPA, the ``grouped_mm`` experts, in train mode. Its
    routing is aux-loss-free (bias only), so its loss has no load-balancing term."""
    import transformers

    from longboat.llm.models.deepseek_v3.hf_config import to_hf_config

    cfg = to_hf_config(m)
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    sparse = m.index_topk is not None
    model_cls = (
        transformers.DeepseekV32ForCausalLM if sparse else transformers.DeepseekV3ForCausalLM
    )
    with device:
        model = model_cls(cfg)
    return model.train()


hf_llama = hf_causal_lm


def hf_experts_kernel(model: torch.nn.Module, compiled: bool) -> str | None:
    """What computes the experts of the HF MoE ``model`` (``None`` for a dense one): the
    configured ``experts_implementation`` and, for ``grouped_mm``, the kernel transformers
    dispatches to. It casts the activations to the expert weights' dtype (autocast does not
    cover grouped GEMMs), so with fp32 weights the GEMMs run in fp32, and under
    ``torch.compile`` it takes its per-expert ``torch.mm`` loop unless the weights are bf16."""
    impl = getattr(model.config, "_experts_implementation", None)
    weights = [p for n, p in model.named_parameters() if ".experts." in n]
    if impl is None or not weights:
        return None
    if impl != "grouped_mm":
        return impl
    dtype = str(weights[0].dtype).removeprefix("torch.")
    if compiled and weights[0].dtype != torch.bfloat16:
        return f"grouped_mm: transformers' per-expert torch.mm loop ({dtype} weights under torch.compile)"
    return f"grouped_mm: torch.nn.functional.grouped_mm on {dtype} operands"


class _CastParams:
    """A transformers module seen with its own parameters passed through ``cast`` (e.g. to
    bf16): the casts are part of the autograd graph, so the gradients reach the module's
    fp32 parameters; every other attribute (buffers, config, methods) is the module's."""

    def __init__(self, module: torch.nn.Module, cast: Callable[[Any], Any]) -> None:
        self._module = module
        for name, p in module.named_parameters(recurse=False):
            setattr(self, name, cast(p))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _bf16(p: torch.Tensor) -> torch.Tensor:
    return p.to(torch.bfloat16)


def _bf16_operand(p: torch.Tensor) -> torch.Tensor:
    return p.to(torch.bfloat16).float()


def _experts_forward(experts: torch.nn.Module, *args: Any) -> Any:
    return type(experts).forward(_CastParams(experts, _bf16), *args)


def _router_forward(router: torch.nn.Module, hidden: torch.Tensor) -> Any:
    with torch.autocast(hidden.device.type, enabled=False):
        return type(router).forward(_CastParams(router, _bf16_operand), _bf16_operand(hidden))


def is_stacked_experts(module: torch.nn.Module) -> bool:
    """A transformers MoE experts module (its expert weights stacked in 3-D parameters, run
    through its ``experts_implementation``)."""
    p = getattr(module, "gate_up_proj", None)
    if p is None:
        p = getattr(module, "up_proj", None)
    return isinstance(p, torch.nn.Parameter) and p.dim() == 3 and hasattr(module, "down_proj")


def is_router(module: torch.nn.Module) -> bool:
    """A transformers MoE router (``DeepseekV3TopkRouter``, ``Qwen3MoeTopKRouter``, ...)."""
    return type(module).__name__.lower().endswith("topkrouter")


def match_moe_precision(
    model: torch.nn.Module, *, experts: bool = True, router: bool = True
) -> dict[str, int]:
    """Run the MoE layers of the HF ``model`` under bf16 autocast at the product's precision
    (module docstring, item 4): ``experts``: the grouped expert GEMMs on bf16 copies of the
    fp32 expert weights; ``router``: the router's GEMM on bf16-rounded operands (the hidden
    states and the weight, as the product stores them) with its logits and scores in fp32,
    outside autocast (which would round the logits to bf16). Patches the instances'
    ``forward``; returns how many modules of each kind it patched."""
    out = {"experts": 0, "routers": 0}
    for m in model.modules():
        if experts and is_stacked_experts(m):
            m.forward = functools.partial(_experts_forward, m)
            out["experts"] += 1
        elif router and is_router(m):
            m.forward = functools.partial(_router_forward, m)
            out["routers"] += 1
    return out


LIGER_DENSE_ONLY = (
    "the baseline applies Liger's dense Llama / Qwen3 patches, which leave Qwen3-MoE's sparse "
    "layers as they are; the MoE shape compares hf_eager and hf_compiled"
)


class HFStep:
    """One HF-Trainer-style step: ``step(tokens, shift_labels=None, i=0) -> loss``."""

    def __init__(
        self,
        model: torch.nn.Module,
        optim: Any,
        device: torch.device,
        *,
        compiled: bool = False,
        liger: bool = False,
        autocast: bool = True,
        lr_factor: Callable[[int], float] | None = None,
    ) -> None:
        if liger and type(model).__name__.startswith("Qwen3Moe"):
            raise ValueError(f"liger: {LIGER_DENSE_ONLY}")
        if liger:
            import liger_kernel.transformers as liger_kernels

            family = "qwen3" if type(model).__name__.startswith("Qwen3") else "llama"
            getattr(liger_kernels, f"apply_liger_kernel_to_{family}")(model=model)
        # Liger patches the instance's forward (not the class's) when given the model.
        self.forward_module = getattr(model.forward, "__func__", model.forward).__module__
        self.logits_materialised: bool | None = None
        """Whether the forward returned ``[tokens, vocab]`` logits (Liger's fused linear
        cross-entropy returns none in training with labels); set by the first step."""
        self.optimizer = ReferenceAdamW(
            model, optim, device, clip=optim.grad_clip, lr_factor=lr_factor
        )
        self.model, self.device, self.autocast = model, device, autocast
        self.forward = torch.compile(model) if compiled else model

    def __call__(self, tokens: torch.Tensor, shift_labels: Any = None, i: int = 0) -> Any:
        kwargs = {} if shift_labels is None else {"shift_labels": shift_labels}
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.forward(input_ids=tokens, labels=tokens, **kwargs)
        if self.logits_materialised is None:
            self.logits_materialised = out.logits is not None
        loss = out.loss
        reported = loss.detach()
        aux = getattr(out, "aux_loss", None)
        if aux is not None:  # MoE: trains on CE + coeff x aux, reports the LM loss as longboat
            reported = reported - self.model.config.router_aux_loss_coef * aux.detach()
        del out  # the logits must not outlive the forward (as when only .loss is kept)
        loss.backward()
        self.optimizer.update(i)
        return reported


@contextlib.contextmanager
def megatron_state(acc: Any, seed: int = 1234) -> Iterator[None]:
    """A one-rank process group (when none is up) and megatron's parallel state."""
    import torch.distributed as dist

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.distributed.multiprocess import find_free_port
    from longboat.core.megatron import parallel_state

    own = not dist.is_initialized()
    if own:
        acc.set_device(0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(find_free_port())
        dist.init_process_group(acc.dist_backend, rank=0, world_size=1)
    try:
        parallel_state.initialize(ParallelConfig(), acc, seed=seed)
        yield
    finally:
        if parallel_state.current_layout() is not None:
            parallel_state.destroy()
        if own and dist.is_initialized():
            dist.destroy_process_group()


class McoreStep:
    """megatron-core's ``GPTModel`` step (inside ``megatron_state``): ``step(tokens, labels)``."""

    def __init__(self, m: Any, optim: Any, device: torch.device) -> None:
        from megatron.core import distributed as mcore_dist
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.transformer_config import TransformerConfig

        tcfg = TransformerConfig(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups,
            kv_channels=m.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=m.norm_eps,
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=m.init_std,
            params_dtype=torch.bfloat16,
            bf16=True,
            pipeline_dtype=torch.bfloat16,
            use_cpu_initialization=device.type != "cuda",  # on the GPU: seconds, not minutes
            gradient_accumulation_fusion=False,  # needs TE / apex
        )
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=m.vocab_size,
            max_sequence_length=m.max_position_embeddings,
            share_embeddings_and_output_weights=m.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(m.rope_theta),
        ).to(device)
        ddp_cfg = mcore_dist.DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        self.ddp = mcore_dist.DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=model)
        self.opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                weight_decay=optim.weight_decay,
                adam_beta1=float(optim.betas[0]),
                adam_beta2=float(optim.betas[1]),
                adam_eps=optim.eps,
                clip_grad=optim.grad_clip,
                bf16=True,
                params_dtype=torch.bfloat16,
            ),
            [self.ddp],
        )
        if device.type == "cuda":
            for inner in getattr(self.opt, "chained_optimizers", None) or [self.opt]:
                for group in inner.optimizer.param_groups:
                    group["fused"], group["foreach"] = True, False
        self.positions: dict[tuple[int, int], torch.Tensor] = {}
        self.device = device

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from megatron.core.distributed import finalize_model_grads

        b, s = tokens.shape
        if (b, s) not in self.positions:
            self.positions[b, s] = torch.arange(s, device=self.device).expand(b, -1)
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        loss = self.ddp(tokens, self.positions[b, s], None, labels=labels).float().mean()
        loss.backward()
        finalize_model_grads([self.ddp])
        self.opt.step()
        return loss.detach()

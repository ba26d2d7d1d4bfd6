"""megatron's tensor-parallel linears with the bias added inside the GEMM.

megatron's local ``ColumnParallelLinear`` / ``RowParallelLinear`` multiply and then add the
bias as a second kernel over the whole output (``output + bias``: one more read and write of
every activation, through a broadcasting kernel). Where nothing but the product and the bias
happens (no sequence parallelism, no gradient all-reduce inside the linear, no
gradient-accumulation fusion, no deferred weight gradients), these subclasses call
``torch.nn.functional.linear`` instead: ``addmm`` with the bias in the GEMM's epilogue on
CUDA. The backward is autograd's for ``linear`` (the same three products and the bias
gradient as a column sum). Everything else falls through to megatron's own path, so weights,
state dicts, sharding and tensor parallelism are megatron's.

The bias is added to the fp32 accumulator before the one rounding to the output dtype,
instead of to the rounded product: at bf16 the outputs differ from megatron's by at most one
rounding step.

``KernelColumnParallelLinear`` / ``KernelRowParallelLinear`` run their GEMMs on an injected
``LinearFn`` (``LayerKernels.linear``: longboat's FP8 linear) where the call is one rank's
product (no sequence parallelism, no deferred weight gradients, not an MoE expert; a frozen
weight, as under LoRA, gets no weight gradient): megatron's weight-gradient accumulation into ``main_grad`` is honoured through
the function's ``wgrad_hook``, the tensor-parallel input-gradient all-reduce through
megatron's ``copy_to_tensor_model_parallel_region``. Everything else runs megatron's own
path, and so does a layer whose ``linear_fn`` is None (``keep_outer_layers``: the first and
last layers stay in the run's dtype). An MLP's down projection can also take the packed fc1
output and a ``GLULinearFn`` (``KernelRowParallelLinear.forward_glu``, called by
``KernelMLP``): the SwiGLU is then fused into the linear, e.g. written straight as FP8
operands.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP

from longboat.core.layer_kernels import GLULinearFn, LinearFn


def _offloading(config: Any) -> bool:
    ctx = getattr(config, "_cpu_offloading_context", None)
    return ctx is not None and getattr(ctx, "inside_context", False)


class EpilogueColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` whose bias is added in the GEMM (see the module doc)."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        bias = kwargs.get("bias")
        plain = (
            bias is not None
            and not args
            and not kwargs.get("gradient_accumulation_fusion")
            and not kwargs.get("allreduce_dgrad")
            and not kwargs.get("sequence_parallel")
            and kwargs.get("grad_output_buffer") is None
            and kwargs.get("gtp_remat_size", 1) <= 1
            and not _offloading(self.config)
        )
        if plain:
            return F.linear(input, weight, bias)
        return super()._forward_impl(input, weight, *args, **kwargs)


class EpilogueRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` whose bias is added in the GEMM where one rank holds the whole
    product (tensor parallel 1); with more ranks the bias follows the all-reduce, as in
    megatron."""

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        plain = (
            self.bias is not None
            and not self.skip_bias_add
            and self.input_size_per_partition == self.input_size  # tensor parallel 1
            and not self.sequence_parallel
            and not self.explicit_expert_comm
            and not self.gradient_accumulation_fusion
            and self.gtp_remat_size <= 1
            and not _offloading(self.config)
        )
        if not plain:
            return super().forward(input_)
        return F.linear(input_, self.weight, self.bias), None


def _main_grad_hook(weight: torch.Tensor) -> tuple[Any, torch.dtype]:
    """``(hook, dtype)``: the hook adds a weight gradient (in ``dtype``, main_grad's) into
    ``weight.main_grad`` and returns what megatron's own linear hands autograd then (a
    stand-in tensor, so megatron DDP's hook on the weight still fires, with
    ``grad_added_to_main_grad`` set; None where the weight has no such flag)."""
    main_grad = weight.main_grad  # the buffer at forward time, as megatron keeps it

    def hook(dw: torch.Tensor) -> torch.Tensor | None:
        main_grad.add_(dw)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return make(main_grad.shape, dtype=weight.dtype, device=main_grad.device)

    return hook, main_grad.dtype


def _kernel_call(
    fn: LinearFn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fusion: bool
) -> torch.Tensor:
    if fusion and hasattr(weight, "main_grad"):
        hook, dtype = _main_grad_hook(weight)
        return fn(x, weight, bias, wgrad_hook=hook, wgrad_dtype=dtype)
    return fn(x, weight, bias)


def _kernel_applies(layer: Any, weight: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:  # fmt: skip
    return (
        layer.linear_fn is not None
        and not args
        and not kwargs.get("sequence_parallel")
        and kwargs.get("grad_output_buffer") is None
        and kwargs.get("gtp_remat_size", 1) <= 1
        and not layer.explicit_expert_comm
        and not _offloading(layer.config)
    )


class KernelMLP(MLP):
    """megatron's ``MLP`` whose down projection takes the SwiGLU fused in where it can: with
    a kernel activation (``use_te_activation_func``, the spec's GLU module), no fc1 bias and no
    per-token scale, ``linear_fc2.forward_glu`` gets the packed fc1 output and the activation
    module (``KernelRowParallelLinear``); everything else is megatron's forward."""

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs: Any) -> Any:  # fmt: skip
        fc2 = self.linear_fc2
        if (
            per_token_scale is not None
            or not self.config.use_te_activation_func
            or not isinstance(fc2, KernelRowParallelLinear)
            or not fc2.fuses_glu()
        ):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        packed, fc1_bias = self.linear_fc1(hidden_states)
        if fc1_bias is not None:
            packed = packed + fc1_bias
        return fc2.forward_glu(packed, self.activation_func)


class KernelColumnParallelLinear(EpilogueColumnParallelLinear):
    """``ColumnParallelLinear`` whose GEMMs run on ``linear_fn`` (see the module doc)."""

    def __init__(self, *args: Any, linear_fn: LinearFn | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.linear_fn = linear_fn
        """The GEMMs' function; None: megatron's (set by ``keep_outer_layers``)."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        if not _kernel_applies(self, weight, args, kwargs):
            return super()._forward_impl(input, weight, *args, **kwargs)
        if kwargs.get("allreduce_dgrad"):  # the input gradient's all-reduce over TP ranks
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            input = copy_to_tensor_model_parallel_region(input, group=kwargs.get("tp_group"))
        fusion = bool(kwargs.get("gradient_accumulation_fusion"))
        return _kernel_call(self.linear_fn, input, weight, kwargs.get("bias"), fusion)


class KernelRowParallelLinear(EpilogueRowParallelLinear):
    """``RowParallelLinear`` whose GEMMs run on ``linear_fn`` (see the module doc); megatron
    reduces the partial products over TP ranks and adds the bias after it. As an MLP's
    down projection, ``forward_glu`` takes the packed fc1 output and runs ``glu_linear_fn``
    (the activation fused into the linear) where ``linear_fn`` would run."""

    def __init__(self, *args: Any, linear_fn: LinearFn | None = None,
                 glu_linear_fn: GLULinearFn | None = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.linear_fn = linear_fn
        """The GEMMs' function; None: megatron's (set by ``keep_outer_layers``)."""
        self.glu_linear_fn = glu_linear_fn
        """``linear_fn`` with the SwiGLU of its packed input fused in (``forward_glu``)."""
        self._pending_glu: Any = None

    def fuses_glu(self) -> bool:
        """Whether ``forward_glu`` can run the fused activation + linear (a kernel linear with
        a ``glu_linear_fn``; the call itself may still fall back, see ``forward_glu``)."""
        return self.linear_fn is not None and self.glu_linear_fn is not None

    def forward_glu(
        self, packed: torch.Tensor, glu: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward(glu(packed))`` for the packed ``[gate, up]`` fc1 output: one call of
        ``glu_linear_fn`` where the kernel applies (one rank's product, as for ``linear_fn``),
        else ``glu`` (the activation module) and then the path ``forward`` takes."""
        if not self.fuses_glu():
            return self.forward(glu(packed))
        self._pending_glu = glu
        try:
            return RowParallelLinear.forward(self, packed)  # through _forward_impl
        finally:
            self._pending_glu = None

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.linear_fn is None:
            return super().forward(input_)
        return RowParallelLinear.forward(self, input_)  # through _forward_impl

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        glu, self._pending_glu = self._pending_glu, None
        applies = _kernel_applies(self, weight, args, kwargs)
        if glu is not None and not applies:
            input = glu(input)
        if not applies:
            return super()._forward_impl(input, weight, *args, **kwargs)
        fusion = bool(kwargs.get("gradient_accumulation_fusion"))
        fn = self.glu_linear_fn if glu is not None else self.linear_fn
        return _kernel_call(fn, input, weight, kwargs.get("bias"), fusion)


def _top_level_layers(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``chunk`` with a ``layer_number`` that sit inside no other such module
    (decoder layers, DiT blocks; not their attention)."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in chunk.named_modules():
        if getattr(module, "layer_number", None) is None:
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    return [m for _, m in found]


def run_high_precision(module: torch.nn.Module) -> None:
    """Put every kernel linear of ``module`` back on megatron's GEMMs (``linear_fn`` None) and
    its grouped MoE experts on the bf16 grouped GEMM (``grouped_linear_fn`` None)."""
    for sub in module.modules():
        if isinstance(sub, KernelColumnParallelLinear | KernelRowParallelLinear):
            sub.linear_fn = None
        if hasattr(sub, "grouped_linear_fn"):  # grouped_experts.GroupedExperts
            sub.grouped_linear_fn = None


def keep_outer_layers(chunks: list[torch.nn.Module], num_layers: int | None = None) -> int:
    """Run the first and last layers (``layer_number`` 1 and ``num_layers``; None: the largest
    number among the chunks' layers) in high precision (``run_high_precision``): FP8 keeps the
    layers nearest the embeddings and the head in the run's dtype. Layers are the modules with
    a ``layer_number`` inside no other (decoder layers, DiT blocks). Returns how many linears
    still run on their kernel."""
    layers = [m for chunk in chunks for m in _top_level_layers(chunk)]
    if num_layers is None:
        num_layers = max((int(m.layer_number) for m in layers), default=1)
    outer = {1, num_layers}
    for layer in layers:
        if layer.layer_number in outer:
            run_high_precision(layer)
    return sum(
        isinstance(m, KernelColumnParallelLinear | KernelRowParallelLinear)
        and m.linear_fn is not None
        for chunk in chunks
        for m in chunk.modules()
    )


__all__ = [
    "EpilogueColumnParallelLinear",
    "EpilogueRowParallelLinear",
    "KernelColumnParallelLinear",
    "KernelMLP",
    "KernelRowParallelLinear",
    "keep_outer_layers",
    "run_high_precision",
]

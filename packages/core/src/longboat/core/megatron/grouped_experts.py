"""The routed experts of a megatron MoE layer as two grouped GEMMs, with no host sync at EP=1.

megatron-core's experts without Transformer Engine are ``SequentialMLP``: a Python loop over
the local experts (three GEMMs and an activation each, forward and backward), fed by a token
dispatcher that copies the per-expert token counts to the host and waits for them, then splits
and re-concatenates the permuted tokens by expert even where that order is already the
experts' (one rank, no expert parallelism). At 128 experts that is thousands of small kernels
and a device round trip per layer.

``GroupedExperts`` holds each projection of all local experts as one ``[E, out, in]`` tensor
and runs them as ``torch.nn.functional.grouped_mm`` over the rows sorted by expert, with the
group ends computed on the device from the counts. ``GroupedMoELayer`` is megatron's
``MoELayer`` whose alltoall dispatcher, with one expert-parallel and one tensor-parallel rank,
keeps the counts on the device, skips the identity sort and permutes by gathers
(``DeviceCountsDispatcher``), so the host never waits for the device in the MoE layer. With expert parallelism the
dispatcher is megatron's (the all-to-all needs its split sizes on the host).

Where ``grouped_mm`` cannot run (an older torch, a dtype or a row width it does not take) the
same weights run one GEMM per expert (``looped_linear``). Values equal ``SequentialMLP``'s on the
same weights (``tests/megatron/test_grouped_experts.py``).

With a ``GroupedLinearFn`` (``LayerKernels.grouped_linear``: the FP8 expert GEMMs of a
``train.precision=fp8`` run) both projections run on it instead; a function that reads the
token counts on the host says so with ``waits_for_host = True``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

GLUFn = Callable[[torch.Tensor], torch.Tensor]
GroupedLinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available() -> bool:
    """Whether this torch has a grouped GEMM (``torch.nn.functional.grouped_mm``)."""
    return _GROUPED_MM is not None


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``grouped_linear`` can run ``x @ weight[e].T`` as one grouped GEMM: a grouped
    GEMM in this torch, bf16 on an accelerator (any float dtype on the CPU), and rows of both
    operands aligned to 16 bytes."""
    return x.dtype == weight.dtype and _grouped_mm_takes(weight)


def _grouped_mm_takes(weight: torch.Tensor) -> bool:
    """``grouped_mm_applies`` for operands of ``weight``'s dtype and device."""
    if _GROUPED_MM is None:
        return False
    if weight.device.type != "cpu" and weight.dtype != torch.bfloat16:
        return False
    size = weight.element_size()
    return all((n * size) % 16 == 0 for n in weight.shape[1:])


def group_ends(tokens_per_expert: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The int32 end row of every expert's group (cumulative counts), on ``device``; a count
    tensor on the host is copied without waiting."""
    counts = tokens_per_expert.to(device=device, non_blocking=True)
    return torch.cumsum(counts, 0, dtype=torch.int32)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, in]`` (rows sorted by expert, expert ``e`` ending at row ``ends[e]``) times
    each expert's ``weight[e]`` ``[out, in]`` transposed: ``[T, out]``, one grouped GEMM."""
    return _GROUPED_MM(x, weight.transpose(1, 2), offs=ends)


def looped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``grouped_linear`` as one GEMM per expert (``counts``: rows per expert, on the host)."""
    return torch.cat([c @ w.t() for c, w in zip(torch.split(x, counts), weight, strict=True)])


class ExpertWeights(torch.nn.Module):
    """One projection of every local expert: ``weight`` ``[experts, out, in]`` (initialised by
    ``init_expert_weights``)."""

    def __init__(
        self, experts: int, out_features: int, in_features: int, *, config: Any, device: Any
    ) -> None:
        super().__init__()
        weight = torch.empty(
            experts, out_features, in_features, dtype=config.params_dtype, device=device
        )
        self.weight = torch.nn.Parameter(weight)
        # megatron's markers: reduced over the expert data-parallel group when experts are
        # sharded, and a "tensor-parallel" tensor (not a duplicate) for the grad norm.
        use_expert_groups = (
            config.expert_model_parallel_size > 1
            or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        self.weight.allreduce = not use_expert_groups
        set_tensor_model_parallel_attributes(self.weight, True, 1, 1)

    def extra_repr(self) -> str:
        return "experts={}, out={}, in={}".format(*self.weight.shape)


@torch.no_grad()
def init_expert_weights(
    projections: list[tuple[torch.Tensor, Callable[[torch.Tensor], Any]]],
) -> None:
    """Initialise stacked expert weights with the values megatron's per-expert linears get
    from the same RNG state: expert by expert, each projection in turn (``(weight,
    init_method)`` pairs in the experts' construction order); on the CPU each slice drawn in
    fp32 and cast, as megatron's CPU init does; on an accelerator from the expert-parallel RNG
    stream."""
    on_cpu = projections[0][0].device.type == "cpu"
    rng = (
        contextlib.nullcontext()
        if on_cpu
        else get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
    )
    with rng:
        for e in range(projections[0][0].shape[0]):
            for weight, init_method in projections:
                if on_cpu:
                    master = torch.empty(weight.shape[1:], dtype=torch.float32)
                    init_method(master)
                    weight[e].copy_(master)
                else:
                    init_method(weight[e])


class GroupedExperts(MegatronModule):
    """megatron's experts contract (``forward(permuted_tokens, tokens_per_expert,
    permuted_probs) -> (output, None)``) over stacked weights: ``linear_fc1.weight``
    ``[E, 2F, H]`` (gate rows then up rows, as each expert's fc1 in megatron) and
    ``linear_fc2.weight`` ``[E, H, F]``.

    ``glu``: the fused SwiGLU on the packed fc1 output (the layer spec's kernel); None runs
    ``activation_func(gate) * up``. ``grouped_linear``: the projections' GEMMs
    (``GroupedLinearFn``, e.g. FP8); None runs ``grouped_linear`` / ``looped_linear`` here. The
    routing probability scales the activation before fc2, as megatron's expert MLP does.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: Any,
        submodules: Any = None,
        pg_collection: Any = None,
        name: str | None = None,
        *,
        glu: GLUFn | None = None,
        grouped_linear: GroupedLinearFn | None = None,
    ) -> None:
        super().__init__(config=config)
        unsupported = {
            "add_bias_linear": config.add_bias_linear,
            "moe_apply_probs_on_input": config.moe_apply_probs_on_input,
            "fp8": bool(config.fp8),
            "expert_tensor_parallel_size > 1": config.expert_tensor_parallel_size > 1,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(
                f"GroupedExperts does not support {', '.join(bad)}; build the layer with "
                "megatron's SequentialMLP experts instead."
            )
        self.num_local_experts = num_local_experts
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        device = _param_device(config)
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        self.linear_fc1 = ExpertWeights(
            num_local_experts, fc1_out, hidden, config=config, device=device
        )
        self.linear_fc2 = ExpertWeights(
            num_local_experts, hidden, ffn, config=config, device=device
        )
        if config.perform_initialization:
            init_expert_weights(
                [
                    (self.linear_fc1.weight, config.init_method),
                    (self.linear_fc2.weight, config.output_layer_init_method),
                ]
            )
        self._glu = glu
        self.grouped_linear_fn = grouped_linear
        """The projections' GEMMs; None: this module's bf16 ones (``keep_outer_layers`` sets
        it to None in the first and last layers)."""

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        if self._glu is not None:
            return self._glu(h)
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            return self.config.activation_func(gate) * up
        return self.config.activation_func(h)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        x = permuted_local_hidden_states
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        fn = self.grouped_linear_fn
        if fn is not None:
            h = self._scale(self._activation(fn(x, w1, tokens_per_expert)), permuted_probs)
            return fn(h, w2, tokens_per_expert), None
        if x.dtype == w1.dtype and self.runs_grouped():
            ends = group_ends(tokens_per_expert, x.device)
            h = grouped_linear(x, w1, ends)
            h = self._scale(self._activation(h), permuted_probs)
            return grouped_linear(h, w2, ends), None
        counts = tokens_per_expert.tolist()
        h = self._scale(self._activation(looped_linear(x, w1, counts)), permuted_probs)
        return looped_linear(h, w2, counts), None

    def runs_grouped(self) -> bool:
        """Whether both projections run as grouped GEMMs on the weights' dtype and device
        (else one GEMM per expert, which reads the counts on the host)."""
        if self.grouped_linear_fn is not None:
            return not getattr(self.grouped_linear_fn, "waits_for_host", False)
        return _grouped_mm_takes(self.linear_fc1.weight) and _grouped_mm_takes(
            self.linear_fc2.weight
        )

    @staticmethod
    def _scale(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return (h * probs.unsqueeze(-1)).to(h.dtype)

    def backward_dw(self) -> None:
        """megatron's delayed weight-gradient hook: nothing is delayed here."""


def _param_device(config: Any) -> torch.device:
    if config.use_cpu_initialization:
        return torch.device("cpu")
    from longboat.core.device import get_accelerator

    return get_accelerator().device()


def expert_order(
    routing_map: torch.Tensor, probs: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where every (token, expert) pair of a dropless top-k routing goes, in megatron's order
    (by expert, then by token): ``rows`` (the token of each permuted row), ``inverse`` (each
    token's ``topk`` permuted rows, ``[tokens, topk]``) and the permuted probabilities."""
    tokens = routing_map.shape[0]
    flat = routing_map.t().reshape(-1).argsort(descending=True, stable=True)[: tokens * topk]
    rows = flat % tokens
    inverse = rows.argsort(stable=True).view(tokens, topk)
    return rows, inverse, probs.t().reshape(-1)[flat]


class _GatherTokens(torch.autograd.Function):
    """``x[rows]`` whose backward sums each token's rows by gathering them (``inverse``), not
    by atomic adds."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor) -> Any:
        ctx.save_for_backward(inverse)
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (inverse,) = ctx.saved_tensors
        return _sum_rows(grad, inverse), None, None


class _SumTokenRows(torch.autograd.Function):
    """Each token's expert outputs summed (``y[inverse].sum(1)``); the backward hands every row
    its token's gradient (a gather by ``rows``)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor) -> Any:
        ctx.save_for_backward(rows)
        return _sum_rows(y, inverse)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None


def _sum_rows(y: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    tokens, topk = inverse.shape
    return y.index_select(0, inverse.reshape(-1)).view(tokens, topk, -1).sum(1)


class DeviceCountsDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's alltoall dispatcher for one expert-parallel and one tensor-parallel rank
    without token dropping (``GroupedMoELayer`` uses it only there, ``keeps_counts_on_device``):
    it returns the per-expert counts as a device tensor (no copy to the host, no wait), skips
    the sort by local expert (then the identity) and moves tokens to and from the expert order
    by gathers in both directions (``expert_order``; megatron's permutation scatters with
    atomic adds, forward or backward)."""

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = hidden_states.shape
        # megatron's dispatcher keeps ``probs`` for its tensor-parallel combine, which this one
        # never runs; kept, they would hold the step's autograd graph (and through the
        # router's grad-accumulation hooks the whole DDP model) until the next forward.
        self.routing_map = routing_map
        x = hidden_states.view(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = x.shape
        self.tokens_per_expert = routing_map.sum(dim=0).long()
        topk = self.config.moe_router_topk
        self._rows, self._inverse, permuted_probs = expert_order(routing_map, probs, topk)
        return _GatherTokens.apply(x, self._rows, self._inverse), permuted_probs

    def _maybe_dtoh_and_synchronize(
        self, point: str, tokens_per_expert: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        return tokens_per_expert

    def dispatch_postprocess(
        self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, permutated_local_input_tokens: torch.Tensor) -> torch.Tensor:
        out = _SumTokenRows.apply(permutated_local_input_tokens, self._rows, self._inverse)
        self._rows = self._inverse = None
        return out.view(self.hidden_shape)


def keeps_counts_on_device(dispatcher: Any) -> bool:
    """Whether ``DeviceCountsDispatcher`` can stand in for megatron's alltoall ``dispatcher``:
    one expert-parallel and one tensor-parallel rank, dropless, no shared experts, no fused
    permutation."""
    config = dispatcher.config
    return (
        type(dispatcher) is MoEAlltoAllTokenDispatcher
        and dispatcher.ep_size == 1
        and dispatcher.tp_size == 1
        and not dispatcher.drop_and_pad
        and config.moe_expert_capacity_factor is None
        and not config.moe_router_padding_for_quantization
        and dispatcher.shared_experts is None
        and not config.moe_permute_fusion
    )


class GroupedMoELayer(MoELayer):
    """megatron's ``MoELayer`` whose alltoall dispatcher becomes ``DeviceCountsDispatcher``
    where its experts are ``GroupedExperts`` (which take the counts on the device) and the
    layout allows it (``keeps_counts_on_device``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.experts, GroupedExperts) and keeps_counts_on_device(
            self.token_dispatcher
        ):
            # Same state, other behaviour: the subclass adds no attributes of its own.
            self.token_dispatcher.__class__ = DeviceCountsDispatcher


def moe_host_sync(modules: Any) -> str | None:
    """Why the forward of an MoE layer among ``modules`` waits for the host (None: none does,
    so the step can be captured as a CUDA graph)."""
    for m in modules:
        if not isinstance(m, MoELayer):
            continue
        if not isinstance(m.experts, GroupedExperts):
            return (
                "megatron's per-expert MoE experts (model.moe_experts=sequential) wait for the "
                "token counts on the host"
            )
        if not m.experts.runs_grouped() and m.experts.grouped_linear_fn is not None:
            return (
                "the FP8 expert GEMMs of this recipe run one expert after the other, which "
                "waits for the token counts on the host"
            )
        if not m.experts.runs_grouped():
            w1 = m.experts.linear_fc1.weight
            return (
                f"the grouped experts run one GEMM per expert ({w1.dtype} on {w1.device.type}, "
                "expert widths of this model), which waits for the token counts on the host"
            )
        if not isinstance(m.token_dispatcher, DeviceCountsDispatcher):
            return (
                "expert parallelism in the MoE layers (megatron's all-to-all waits for its "
                "split sizes on the host)"
            )
    return None


def grouped_experts_builder(glu: GLUFn | None, grouped_linear: GroupedLinearFn | None = None) -> Any:  # fmt: skip
    """The ``MoESubmodules.experts`` builder of ``GroupedExperts`` with ``glu`` and
    ``grouped_linear``."""
    return functools.partial(GroupedExperts, glu=glu, grouped_linear=grouped_linear)

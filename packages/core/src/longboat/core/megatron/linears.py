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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


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


__all__ = ["EpilogueColumnParallelLinear", "EpilogueRowParallelLinear"]

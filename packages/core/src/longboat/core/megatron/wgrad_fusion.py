"""Weight gradients accumulated straight into megatron's ``main_grad`` buffers.

Without it, every linear layer's backward computes its weight gradient as a new bf16 tensor,
and a DDP hook then adds it into the layer's fp32 ``main_grad`` slice of the grad buffer: one
more pass over every weight (read bf16 + read fp32 + write fp32, 10 bytes a parameter) and a
bf16 gradient allocated per layer. megatron can instead let the GEMM accumulate into
``main_grad`` itself (``TransformerConfig.gradient_accumulation_fusion``), but only through
apex's ``fused_weight_gradient_mlp_cuda`` extension, which longboat does not require.

:func:`install_wgrad_fusion` gives megatron a stand-in for that extension built on torch:

- fp32 ``main_grad``: ``addmm`` with bf16 inputs and fp32 output (``out_dtype``), accumulated
  in place (cuBLAS ``C = A B + C``): the product is never rounded to bf16, so the gradient is
  at least as precise as before (one GEMM instead of a GEMM + an add pass);
- bf16 / fp16 ``main_grad``: ``addmm_`` in that dtype;
- where ``addmm`` has no ``out_dtype`` (CPU), the product is formed in fp32 and added:
  the same values, one extra pass.

Turn it on per model with ``TransformerConfig.gradient_accumulation_fusion=True`` after
installing.
"""

from __future__ import annotations

import torch

_STATE: dict[str, bool] = {}


def _accum_fp32_out_dtype(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:  # fmt: skip
    torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)


def _accum_fp32_fallback(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:  # fmt: skip
    main_grad.add_(grad_output.t().float() @ total_input.float())


def _out_dtype_works(device: torch.device) -> bool:
    """Check once per device type that in-place ``addmm(out_dtype=fp32)`` accumulates right."""
    key = f"out_dtype:{device.type}"
    if key not in _STATE:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(64, 48, device=device, generator=g).to(torch.bfloat16)
            dy = torch.randn(64, 32, device=device, generator=g).to(torch.bfloat16)
            acc = torch.randn(32, 48, device=device, generator=g)
            want = acc + dy.t().float() @ x.float()
            _accum_fp32_out_dtype(x, dy, acc)
            _STATE[key] = bool(torch.allclose(acc, want, rtol=1e-4, atol=1e-3))
        except (RuntimeError, TypeError, NotImplementedError):
            _STATE[key] = False
    return _STATE[key]


class TorchWgradAccumulation:
    """The two functions megatron calls on apex's ``fused_weight_gradient_mlp_cuda``:
    ``main_grad [out, in] += grad_output[T, out]^T @ total_input[T, in]``."""

    @staticmethod
    def wgrad_gemm_accum_fp32(
        total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
    ) -> None:
        if total_input.dtype != torch.float32 and _out_dtype_works(main_grad.device):
            _accum_fp32_out_dtype(total_input, grad_output, main_grad)
        else:
            _accum_fp32_fallback(total_input, grad_output, main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(
        total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
    ) -> None:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def install_wgrad_fusion() -> None:
    """Make megatron's gradient-accumulation fusion available (idempotent)."""
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
    layers._grad_accum_fusion_available = True
    _STATE["installed"] = True


def single_pass_grads(
    *,
    precision: str,
    microbatches: int,
    data_parallel: int,
    context_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> bool:
    """True when a bf16 grad buffer holds exactly what the fp32 one would.

    With bf16 weights the unfused path adds a bf16 weight gradient to a zeroed fp32 buffer
    (exact) once per step when there is one microbatch and no gradient reduction between
    ranks (data / context parallel 1; pipeline parallel 1, whose tied-embedding all-reduce
    would otherwise sum in bf16). A bf16 buffer written by ``wgrad_gemm_accum_fp16`` then
    holds the same bf16-rounded GEMM result (up to cuBLAS's kernel choice for beta=1) with
    half the buffer memory; megatron's optimizer reads it into fp32 (``main_grad.float()``,
    a transient copy after the activations are freed).
    """
    return (
        precision == "bf16"
        and microbatches == 1
        and data_parallel == 1
        and context_parallel == 1
        and pipeline_parallel == 1
    )


def grad_plan(
    *,
    precision: str,
    microbatches: int,
    data_parallel: int,
    context_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> tuple[bool, bool]:
    """``(gradient_accumulation_fusion, grad_reduce_in_fp32)`` for a run.

    bf16: fusion on (install with ``install_wgrad_fusion``); an fp32 buffer then accumulates
    the unrounded fp32 product (at least as precise as the hook's bf16 gradient + add), a
    bf16 buffer where ``single_pass_grads`` holds (same values, half the memory). Other
    precisions: megatron's default (no fusion, fp32 buffer).
    """
    if precision != "bf16":
        return False, True
    single = single_pass_grads(
        precision=precision,
        microbatches=microbatches,
        data_parallel=data_parallel,
        context_parallel=context_parallel,
        pipeline_parallel=pipeline_parallel,
    )
    return True, not single

"""The torch stand-in for apex's fused weight-gradient accumulation."""

from __future__ import annotations

import torch

from longboat.core.megatron.wgrad_fusion import TorchWgradAccumulation, install_wgrad_fusion


def test_fp32_main_grad_accumulates_the_unrounded_product() -> None:
    torch.manual_seed(0)
    x = torch.randn(40, 24).to(torch.bfloat16)
    dy = torch.randn(40, 16).to(torch.bfloat16)
    main = torch.randn(16, 24)
    want = main + dy.double().t() @ x.double()  # the exact product of the bf16 inputs
    TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, dy, main)
    assert main.dtype == torch.float32
    torch.testing.assert_close(main.double(), want, rtol=1e-6, atol=1e-5)
    # ... and twice accumulates twice (gradient accumulation over micro-batches)
    TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, dy, main)
    torch.testing.assert_close(
        main.double(), want + dy.double().t() @ x.double(), rtol=1e-6, atol=1e-5
    )


def test_bf16_main_grad_accumulates_in_place() -> None:
    torch.manual_seed(1)
    x = torch.randn(32, 8).to(torch.bfloat16)
    dy = torch.randn(32, 4).to(torch.bfloat16)
    main = torch.zeros(4, 8, dtype=torch.bfloat16)
    ptr = main.data_ptr()
    TorchWgradAccumulation.wgrad_gemm_accum_fp16(x, dy, main)
    assert main.data_ptr() == ptr and main.dtype == torch.bfloat16
    # from zero, one accumulation equals the bf16 GEMM rounded once
    torch.testing.assert_close(
        main, (dy.float().t() @ x.float()).to(torch.bfloat16), rtol=1e-2, atol=1e-2
    )


def test_install_makes_megatron_accept_the_fusion() -> None:
    from megatron.core.tensor_parallel import layers

    missing = object()
    before = (
        getattr(layers, "fused_weight_gradient_mlp_cuda", missing),
        layers._grad_accum_fusion_available,
    )
    try:
        install_wgrad_fusion()
        assert layers._grad_accum_fusion_available is True
        assert layers.fused_weight_gradient_mlp_cuda is TorchWgradAccumulation
    finally:
        if before[0] is missing:
            del layers.fused_weight_gradient_mlp_cuda
        else:
            layers.fused_weight_gradient_mlp_cuda = before[0]
        layers._grad_accum_fusion_available = before[1]

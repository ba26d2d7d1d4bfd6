"""FP8 training: quantisation (Triton with torch references), the FP8 GEMM, an FP8 linear
(forward, input and weight gradients in FP8) and the adaptive FP8-or-bf16 chooser.

Recipes (``RECIPES``): ``blockwise`` (1x128 activation tiles, 128x128 weight blocks, e4m3),
``rowwise`` (a scale per row, e4m3), ``tensorwise`` (a scale per tensor, e4m3 forward, e5m2
gradients); ``adaptive`` picks bf16 or one of them per GEMM shape by measured speed
(``adaptive``). ``fp8_grouped_linear``: an MoE layer's expert GEMMs with per-expert scales
(``grouped``). On CUDA the GEMMs run on ``torch.nn.functional.scaled_mm`` (and
``scaled_grouped_mm``); elsewhere they are emulated (dequantise, multiply in fp32), which is how the CPU tests check them.
"""

from longboat.kernels.fp8.adaptive import (
    HIGH_PRECISION,
    AdaptiveChooser,
    TimingCache,
    choice_table,
    choose,
    measure_linear,
)
from longboat.kernels.fp8.gemm import emulated_mm, fp8_mm, resolve_gemm_backend
from longboat.kernels.fp8.grouped import fp8_grouped_linear, high_precision_grouped_linear
from longboat.kernels.fp8.linear import (
    RECIPES,
    Fp8Recipe,
    fp8_linear,
    get_recipe,
    high_precision_linear,
)
from longboat.kernels.fp8.quantize import (
    BLOCK,
    E4M3,
    E5M2,
    Fp8Operand,
    fp8_max,
    quantize,
    quantize_torch,
    transpose_blockwise,
)

__all__ = [
    "BLOCK",
    "E4M3",
    "E5M2",
    "HIGH_PRECISION",
    "RECIPES",
    "AdaptiveChooser",
    "Fp8Operand",
    "Fp8Recipe",
    "TimingCache",
    "choice_table",
    "choose",
    "emulated_mm",
    "fp8_grouped_linear",
    "fp8_linear",
    "fp8_max",
    "fp8_mm",
    "get_recipe",
    "high_precision_grouped_linear",
    "high_precision_linear",
    "measure_linear",
    "quantize",
    "quantize_torch",
    "resolve_gemm_backend",
    "transpose_blockwise",
]

"""``EpilogueColumnParallelLinear`` / ``EpilogueRowParallelLinear``: megatron's linears with
the bias added inside the GEMM where nothing else happens in the linear.

On the same weights they must compute megatron's outputs and gradients (fp32 on the CPU,
within 1e-6 of the largest value), run no separate ``add`` for the bias on that path, and
leave megatron's path (with its ``add``) where the bias is returned to the caller.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs longboat-core[megatron]")

from longboat.core.distributed import run_multiprocess

TOL = 1e-6


def _count_ops(fn, names: tuple[str, ...]) -> tuple[object, int]:  # type: ignore[no-untyped-def]
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket.__name__ in names:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        out = fn()
    return out, Count.n


def _worker(rank: int, world: int) -> dict[str, object]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.layer_kernels import LayerKernels
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.decoder_config import DecoderModelConfig, to_transformer_config
    from longboat.core.megatron.linears import (
        EpilogueColumnParallelLinear,
        EpilogueRowParallelLinear,
    )
    from longboat.core.megatron.specs import LongboatSpecProvider

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        arch = DecoderModelConfig(norm_eps=1e-6, max_position_embeddings=4096, vocab_size=64, hidden_size=24, num_layers=1, num_attention_heads=4,
                           num_query_groups=4, head_dim=6, ffn_hidden_size=40)  # fmt: skip
        cfg = to_transformer_config(arch, precision="fp32", use_cpu_initialization=True)
        out: dict[str, object] = {}
        provider = LongboatSpecProvider(LayerKernels())
        out["provider"] = (provider.column_parallel_linear().__name__,
                           provider.row_parallel_linear().__name__)  # fmt: skip
        x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(0))
        dy = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(1))

        def build(cls, **kw):  # type: ignore[no-untyped-def]
            torch.manual_seed(0)
            common = dict(config=cfg, init_method=torch.nn.init.normal_, bias=True)
            if issubclass(cls, RowParallelLinear):
                return cls(40, 24, input_is_parallel=True, **common, **kw)
            return cls(24, 40, gather_output=False, **common, **kw)

        def run(layer, inp, grad):  # type: ignore[no-untyped-def]
            inp = inp.clone().requires_grad_(True)
            (y, bias), adds = _count_ops(lambda: layer(inp), ("add",))
            y = y if bias is None else y + bias
            y.backward(grad)
            grads = [inp.grad] + [p.grad for p in layer.parameters()]
            return y.detach(), grads, adds

        for kind, (ref_cls, cls, inp, grad) in {
            "column": (ColumnParallelLinear, EpilogueColumnParallelLinear, x, dy),
            "row": (RowParallelLinear, EpilogueRowParallelLinear, dy, x),
        }.items():
            for skip in (False, True):
                ref, new = build(ref_cls, skip_bias_add=skip), build(cls, skip_bias_add=skip)
                new.load_state_dict(ref.state_dict())
                want, want_grads, ref_adds = run(ref, inp, grad)
                got, got_grads, adds = run(new, inp, grad)
                scale = want.abs().max().item()
                worst = max(
                    (g - w).abs().max().item() / w.abs().max().item()
                    for g, w in zip(got_grads, want_grads, strict=True)
                )
                out[f"{kind}_{skip}"] = ((got - want).abs().max().item() / scale, worst,
                                          adds, ref_adds)  # fmt: skip
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_epilogue_linears_equal_megatron_and_skip_the_bias_add() -> None:
    (out,) = run_multiprocess(_worker, 1)
    assert out["provider"] == ("EpilogueColumnParallelLinear", "EpilogueRowParallelLinear")
    for kind in ("column", "row"):
        y_err, grad_err, adds, ref_adds = out[f"{kind}_False"]
        assert y_err <= TOL and grad_err <= TOL, (kind, y_err, grad_err)
        # megatron adds the bias in its own kernel; the epilogue path has none
        assert ref_adds >= 1 and adds == 0, (kind, adds, ref_adds)
        # the bias handed back to the caller (skip_bias_add): megatron's own path, unchanged
        y_err, grad_err, adds, ref_adds = out[f"{kind}_True"]
        assert y_err == 0.0 and grad_err == 0.0 and adds == ref_adds, (kind, out[f"{kind}_True"])

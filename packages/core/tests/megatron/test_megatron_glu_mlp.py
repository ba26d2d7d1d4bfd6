"""``KernelMLP``: the MLP's SwiGLU fused into its down projection (``LayerKernels.glu_linear``).

core cannot use longboat.kernels, so the injected functions here are counting torch
functions with the ``GLUFn`` / ``LinearFn`` / ``GLULinearFn`` contracts (the FP8 kernel is
tested in packages/kernels). With ``glu_linear`` the decoder's MLPs must hand the packed fc1
output to it instead of calling the activation and then ``linear`` (fp32: logits and every
gradient bit-identical, the same operations in the same order), and take the unfused path
where the down projection is kept on megatron's GEMMs (``run_high_precision``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs longboat-core[megatron]")

from longboat.core.distributed import run_multiprocess


def _kernels(calls: dict[str, int], fused: bool):  # type: ignore[no-untyped-def]
    from longboat.core.layer_kernels import LayerKernels

    def swiglu(x: torch.Tensor) -> torch.Tensor:
        calls["swiglu"] += 1
        n = x.shape[-1] // 2
        return F.silu(x[..., :n]) * x[..., n:]

    def linear(x, weight, bias=None, **kw):  # type: ignore[no-untyped-def]
        calls["linear"] += 1
        return F.linear(x, weight, bias)

    def glu_linear(h, weight, bias=None, **kw):  # type: ignore[no-untyped-def]
        calls["glu_linear"] += 1
        n = h.shape[-1] // 2
        return F.linear(F.silu(h[..., :n]) * h[..., n:], weight, bias)

    return LayerKernels(swiglu=swiglu, linear=linear, glu_linear=glu_linear if fused else None)


def _model(kernels):  # type: ignore[no-untyped-def]
    from longboat.core.megatron.decoder_config import DecoderModelConfig, to_transformer_config
    from longboat.core.megatron.model import build_decoder_model
    from longboat.core.megatron.specs import decoder_layer_spec

    arch = DecoderModelConfig(norm_eps=1e-6, max_position_embeddings=4096,
        vocab_size=64, hidden_size=48, num_layers=2, num_attention_heads=4,
        num_query_groups=2, head_dim=12, ffn_hidden_size=80,
    )  # fmt: skip
    tcfg = to_transformer_config(
        arch, precision="fp32", use_cpu_initialization=True, kernel_activation=True
    )
    torch.manual_seed(0)
    (model,) = build_decoder_model(arch, tcfg, decoder_layer_spec(kernels=kernels))
    return model


def _run(model, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (2, 10), generator=g)
    pos = torch.arange(10).unsqueeze(0).expand(2, -1)
    model.zero_grad(set_to_none=True)
    logits = model(tokens, pos, None)
    (logits.float() * torch.randn(logits.shape, generator=g)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int) -> dict[str, object]:
    from megatron.core.transformer.mlp import MLP

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.linears import KernelMLP, run_high_precision

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        out: dict[str, object] = {}
        ref_calls = {"swiglu": 0, "linear": 0, "glu_linear": 0}
        calls = dict(ref_calls)
        plain, fused = _model(_kernels(ref_calls, False)), _model(_kernels(calls, True))
        fused.load_state_dict(plain.state_dict())
        out["types"] = (
            [type(x.mlp) is MLP for x in plain.decoder.layers],
            [
                isinstance(x.mlp, KernelMLP) and x.mlp.linear_fc2.fuses_glu()
                for x in fused.decoder.layers
            ],
        )
        ref_logits, ref_grads = _run(plain)
        got_logits, got_grads = _run(fused)
        out["calls"] = (dict(ref_calls), dict(calls))
        out["equal"] = torch.equal(ref_logits, got_logits) and all(
            torch.equal(got_grads[n], g) for n, g in ref_grads.items()
        )
        out["grads_nonzero"] = min(float(g.abs().max()) for g in got_grads.values())

        # A layer kept on megatron's GEMMs (FP8's first and last layers): activation, then fc2.
        for model in (plain, fused):
            run_high_precision(model.decoder.layers[0])
        for c in (ref_calls, calls):
            c.update(swiglu=0, linear=0, glu_linear=0)
        ref_logits, ref_grads = _run(plain)
        got_logits, got_grads = _run(fused)
        out["kept_calls"] = (dict(ref_calls), dict(calls))
        out["kept_equal"] = torch.equal(ref_logits, got_logits) and all(
            torch.equal(got_grads[n], g) for n, g in ref_grads.items()
        )
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_glu_fused_into_the_down_projection_equals_the_unfused_mlp() -> None:
    (out,) = run_multiprocess(_worker, 1)
    assert out["types"] == ([True, True], [True, True])
    # per layer: qkv, proj, fc1 and fc2 on `linear` (unfused) vs fc2 on `glu_linear` (fused)
    assert out["calls"] == (
        {"swiglu": 2, "linear": 8, "glu_linear": 0},
        {"swiglu": 0, "linear": 6, "glu_linear": 2},
    )
    assert out["equal"] and out["grads_nonzero"] > 0
    # layer 1 on megatron's GEMMs: its MLP runs the activation module and megatron's fc2
    assert out["kept_calls"] == (
        {"swiglu": 2, "linear": 4, "glu_linear": 0},
        {"swiglu": 1, "linear": 3, "glu_linear": 1},
    )
    assert out["kept_equal"]

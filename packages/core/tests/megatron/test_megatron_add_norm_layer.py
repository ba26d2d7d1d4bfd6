"""``AddNormTransformerLayer``: the attention residual add fused into the pre-MLP norm.

core cannot use longboat.kernels, so the injected ``add_rms_norm`` here is a counting torch
function with the ``AddRMSNormFn`` contract; the kernel itself is tested in packages/kernels.
The fused layer must compute what megatron's ``TransformerLayer`` computes (fp32: logits
bit-identical, every gradient within 1e-6 relative: the add's two gradients are summed in a
different place), take megatron's path where the fusion does not apply (hidden dropout in
training), and keep an fp32 residual stream fp32.
"""

from __future__ import annotations

import pytest
import torch

from longboat.core.distributed import run_multiprocess

GRAD_TOL = 1e-6  # fp32, relative to each gradient's max


def _add_rms_norm(calls: list[tuple[torch.dtype, torch.dtype]]):  # type: ignore[no-untyped-def]
    from longboat.core.megatron.specs import torch_rms_norm

    def fn(x, residual, weight, eps):  # type: ignore[no-untyped-def]
        calls.append((x.dtype, residual.dtype))
        h = x.to(residual.dtype) + residual
        return torch_rms_norm(h, weight, eps).to(x.dtype), h

    return fn


def _model(kernels, precision: str = "fp32", **overrides):  # type: ignore[no-untyped-def]
    from longboat.core.megatron.decoder_config import DecoderModelConfig, to_transformer_config
    from longboat.core.megatron.model import build_decoder_model
    from longboat.core.megatron.specs import decoder_layer_spec

    arch = DecoderModelConfig(norm_eps=1e-6, max_position_embeddings=4096,
        vocab_size=64, hidden_size=48, num_layers=2, num_attention_heads=4,
        num_query_groups=2, head_dim=12, ffn_hidden_size=80,
    )  # fmt: skip
    tcfg = to_transformer_config(
        arch, precision=precision, use_cpu_initialization=True, **overrides
    )
    torch.manual_seed(0)
    (model,) = build_decoder_model(arch, tcfg, decoder_layer_spec(kernels=kernels))
    with torch.no_grad():  # random norm weights: a skipped or swapped norm shows
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
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
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.specs import AddNormTransformerLayer, LayerKernels

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        out: dict[str, object] = {}
        calls: list[tuple[torch.dtype, torch.dtype]] = []
        fused_k = LayerKernels(add_rms_norm=_add_rms_norm(calls))

        plain, fused = _model(LayerKernels()), _model(fused_k)
        fused.load_state_dict(plain.state_dict())
        layers = fused.decoder.layers
        out["types"] = [type(x).__name__ for x in layers] + [
            type(x).__name__ for x in plain.decoder.layers
        ]
        out["plain_is_megatron"] = all(type(x) is TransformerLayer for x in plain.decoder.layers)
        out["fusable"] = [
            isinstance(x, AddNormTransformerLayer) and x.fuses_attention_add for x in layers
        ]
        ref_logits, ref_grads = _run(plain)
        got_logits, got_grads = _run(fused)
        out["calls"] = len(calls)
        out["logits_equal"] = torch.equal(ref_logits, got_logits)
        out["grad_rel"] = max(
            float((got_grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30))
            for n, g in ref_grads.items()
        )
        out["grads_nonzero"] = min(float(g.abs().max()) for g in got_grads.values())

        # Hidden dropout in training: megatron's path (dropout before the add); eval: fused.
        calls.clear()
        dropped = _model(fused_k, hidden_dropout=0.1)
        dropped.load_state_dict(plain.state_dict())
        dropped.train()
        _run(dropped)
        out["dropout_train_calls"] = len(calls)
        dropped.eval()
        plain.eval()
        with torch.no_grad():
            tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
            pos = torch.arange(10).unsqueeze(0).expand(2, -1)
            a, b = dropped(tokens, pos, None), plain(tokens, pos, None)
        out["dropout_eval_calls"] = len(calls)
        out["dropout_eval_equal"] = torch.equal(a, b)

        # fp32 residual stream in a bf16 model: the add runs into an fp32 stream.
        calls.clear()
        res = {}
        for name, k in (("plain", LayerKernels()), ("fused", fused_k)):
            m = _model(k, precision="bf16", fp32_residual_connection=True)
            m.load_state_dict(plain.state_dict())  # fp32 -> bf16 copy, same values for both
            res[name] = _run(m)
        out["fp32_stream_calls"] = sorted(set(calls))
        out["fp32_stream_logit_diff"] = float(
            (res["plain"][0].float() - res["fused"][0].float()).abs().max()
        )
        out["fp32_stream_logit_scale"] = float(res["plain"][0].float().abs().max())
        out["fp32_stream_grad_rel"] = max(
            float((res["fused"][1][n] - g).float().abs().max() / g.float().abs().max())
            for n, g in res["plain"][1].items()
        )
        return out
    finally:
        parallel_state.destroy()


@pytest.fixture(scope="module")
def result() -> dict[str, object]:
    (out,) = run_multiprocess(_worker, 1)
    return out


@pytest.mark.multiprocess
def test_fused_layer_equals_megatrons_layer(result: dict[str, object]) -> None:
    assert result["types"] == ["AddNormTransformerLayer"] * 2 + ["TransformerLayer"] * 2
    assert result["plain_is_megatron"] and result["fusable"] == [True, True]
    assert result["calls"] == 2, result  # one fused call per layer, forward only
    assert result["logits_equal"], result
    assert result["grad_rel"] <= GRAD_TOL and result["grads_nonzero"] > 0.0, result


@pytest.mark.multiprocess
def test_hidden_dropout_in_training_takes_megatrons_path(result: dict[str, object]) -> None:
    assert result["dropout_train_calls"] == 0, result
    assert result["dropout_eval_calls"] == 2 and result["dropout_eval_equal"], result


@pytest.mark.multiprocess
def test_fp32_residual_stream_stays_fp32(result: dict[str, object]) -> None:
    """bf16 attention output added into the fp32 stream; normed handed on in bf16. Same
    numbers as megatron's unfused layer up to the place the bf16 rounding of the norm output
    happens (measured identical; bound one bf16 ulp of the logit scale, 2^-8 relative)."""
    assert result["fp32_stream_calls"] == [(torch.bfloat16, torch.float32)], result
    scale = float(result["fp32_stream_logit_scale"])
    assert float(result["fp32_stream_logit_diff"]) <= scale * 2.0**-8, result
    assert float(result["fp32_stream_grad_rel"]) <= 2.0**-7, result

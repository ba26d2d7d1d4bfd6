"""Packed documents reach longboat's attention spec as offsets: a decoder given ``cu_seqlens``
as its ``attention_mask`` computes what it computes with megatron's dense block mask (fp32:
logits and every gradient within 1e-6), also with full activation recompute, and no
document sees another's tokens."""

from __future__ import annotations

import torch

from longboat.core.distributed import run_multiprocess

TOL = 1e-6


def _model(**overrides):  # type: ignore[no-untyped-def]
    from longboat.core.megatron.decoder_config import DecoderModelConfig, to_transformer_config
    from longboat.core.megatron.model import build_decoder_model
    from longboat.core.megatron.specs import LayerKernels, decoder_layer_spec

    arch = DecoderModelConfig(norm_eps=1e-6, max_position_embeddings=4096,
        vocab_size=64, hidden_size=48, num_layers=2, num_attention_heads=4,
        num_query_groups=2, head_dim=12, ffn_hidden_size=80,
    )  # fmt: skip
    tcfg = to_transformer_config(arch, precision="fp32", use_cpu_initialization=True, **overrides)
    torch.manual_seed(0)
    (model,) = build_decoder_model(arch, tcfg, decoder_layer_spec(kernels=LayerKernels()))
    return model


def _run(model, tokens, pos, mask):  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    logits = model(tokens, pos, mask)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (logits.float() * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int) -> dict[str, float]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        cu = [0, 5, 6, 13, 16]
        g = torch.Generator().manual_seed(2)
        tokens = torch.randint(0, 64, (1, 16), generator=g)
        bounds = torch.tensor(cu)
        doc = torch.bucketize(torch.arange(16), bounds[1:], right=True)
        pos = (torch.arange(16) - bounds[doc])[None]
        dense = (doc[:, None] != doc[None, :])[None, None]  # megatron: True = blocked
        offsets = torch.tensor(cu, dtype=torch.int32)
        out: dict[str, float] = {}
        for name, kw in (("plain", {}), ("recompute", {"recompute_granularity": "full",
                         "recompute_method": "uniform", "recompute_num_layers": 1})):  # fmt: skip
            model = _model(**kw)
            ref_logits, ref_grads = _run(model, tokens, pos, dense)
            got_logits, got_grads = _run(model, tokens, pos, offsets)
            out[f"{name}_logits"] = float((got_logits - ref_logits).abs().max())
            out[f"{name}_grads"] = max(
                float((got_grads[n] - r).abs().max() / r.abs().max().clamp(min=1e-30))
                for n, r in ref_grads.items()
            )
        # Documents are separate: the second document alone gives its logits in the row.
        model = _model()
        with torch.no_grad():
            row = model(tokens, pos, offsets)
            alone = model(tokens[:, 6:13], pos[:, 6:13], None)
        out["alone"] = float((row[:, 6:13] - alone).abs().max())
        return out
    finally:
        parallel_state.destroy()


def test_offsets_equal_the_dense_block_mask() -> None:
    (out,) = run_multiprocess(_worker, 1)
    for key, value in out.items():
        assert value < TOL, f"{key}: {value:.2e}"

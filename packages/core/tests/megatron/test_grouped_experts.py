"""``GroupedExperts`` / ``GroupedMoELayer``: megatron's MoE layer with the routed experts as two
grouped GEMMs over stacked weights, and the counts kept on the device at EP=1.

The grouped model must compute what megatron's ``SequentialMLP`` computes on the same weights
(fp32 on the CPU: logits within 1e-5, every gradient within 1e-5 of its max), with empty
experts among the groups; its dispatch at EP=1 must neither copy counts to the host nor sort
chunks by expert; the per-expert fallback (rows ``grouped_mm`` does not take) must equal the
grouped GEMM.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs longboat-core[megatron]")

from longboat.core.distributed import run_multiprocess

TOL = 1e-5  # fp32: max abs difference, relative to the reference's max


def _model(moe_experts: str, experts: int = 4, topk: int = 2, ffn: int = 16, **overrides):  # type: ignore[no-untyped-def]
    from longboat.core.megatron.decoder_config import DecoderModelConfig, to_transformer_config
    from longboat.core.megatron.model import build_decoder_model
    from longboat.core.megatron.specs import decoder_layer_spec

    arch = DecoderModelConfig(norm_eps=1e-6, max_position_embeddings=4096,
        vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
        num_query_groups=2, head_dim=8, ffn_hidden_size=48, num_experts=experts,
        moe_topk=topk, moe_ffn_hidden_size=ffn,
    )  # fmt: skip
    tcfg = to_transformer_config(arch, precision="fp32", use_cpu_initialization=True, **overrides)
    torch.manual_seed(0)
    spec = decoder_layer_spec(num_experts=experts, moe_experts=moe_experts)
    (model,) = build_decoder_model(arch, tcfg, spec)
    return model


def _stack_from_sequential(sequential, grouped) -> None:  # type: ignore[no-untyped-def]
    """Copy ``sequential``'s weights into ``grouped`` (per-expert linears -> stacked)."""
    state = sequential.state_dict()
    out = {}
    for name in grouped.state_dict():
        if ".mlp.experts.linear_fc" in name:
            head, fc = name.split(".mlp.experts.")
            fc = fc.removesuffix(".weight")
            n = sum(1 for k in state if k.startswith(f"{head}.mlp.experts.local_experts.")
                    and k.endswith(f"{fc}.weight"))  # fmt: skip
            out[name] = torch.stack(
                [state[f"{head}.mlp.experts.local_experts.{e}.{fc}.weight"] for e in range(n)]
            )
        else:
            out[name] = state[name]
    grouped.load_state_dict(out)


def _run(model, tokens):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    model.zero_grad(set_to_none=True)
    logits = model(tokens, pos, None)
    weights = torch.randn(logits.shape, generator=g).to(logits.device)
    (logits.float() * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _stacked_grads(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sequential tensors (gradients or weights) with the per-expert ones stacked like
    ``GroupedExperts``'."""
    out: dict[str, list[torch.Tensor]] = {}
    plain = {}
    for name, g in grads.items():
        if ".local_experts." in name:
            head, rest = name.split(".local_experts.")
            fc = rest.split(".", 1)[1]
            out.setdefault(f"{head}.{fc}", []).append(g)
        else:
            plain[name] = g
    return plain | {k: torch.stack(v) for k, v in out.items()}


def _worker(rank: int, world: int) -> dict[str, object]:
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.experts import SequentialMLP

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.grouped_experts import (
        DeviceCountsDispatcher,
        GroupedExperts,
        GroupedMoELayer,
        moe_host_sync,
    )

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        out: dict[str, object] = {}
        sequential, grouped = _model("sequential"), _model("grouped")
        # Same seed, same weights: the stacked init draws what the per-expert linears draw.
        want = _stacked_grads(dict(sequential.named_parameters()))
        got = dict(grouped.named_parameters())
        out["init_equal"] = sorted(want) == sorted(got) and all(
            torch.equal(got[k], v) for k, v in want.items()
        )
        _stack_from_sequential(sequential, grouped)
        out["host_sync"] = (moe_host_sync(grouped.modules()), moe_host_sync(sequential.modules()),
                            moe_host_sync(_model("grouped", ffn=10).modules()))  # fmt: skip
        moe = grouped.decoder.layers[0].mlp
        out["types"] = (type(moe).__name__, type(moe.experts).__name__,
                        type(moe.token_dispatcher).__name__)  # fmt: skip
        out["sequential_experts"] = type(sequential.decoder.layers[0].mlp.experts).__name__
        assert isinstance(moe, GroupedMoELayer) and isinstance(moe.experts, GroupedExperts)
        assert isinstance(moe.token_dispatcher, DeviceCountsDispatcher)
        assert isinstance(sequential.decoder.layers[0].mlp.experts, SequentialMLP)

        # 3 tokens routed top-2 over 8 experts leave experts empty in every layer.
        for shape, experts in (((2, 9), 4), ((1, 3), 8)):
            seq = _model("sequential", experts=experts)
            grp = _model("grouped", experts=experts)
            _stack_from_sequential(seq, grp)
            counts: list[torch.Tensor] = []
            grp.decoder.layers[0].mlp.experts.register_forward_pre_hook(
                lambda m, args, counts=counts: counts.append(args[1].clone())
            )
            tokens = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(3))
            want_logits, want_grads = _run(seq, tokens)
            # The grouped layer must not copy counts to the host nor sort chunks at EP=1.
            names = ("sort_chunks_by_idxs", "maybe_move_tensor_to_cpu", "permute", "unpermute")
            saved = {n: getattr(token_dispatcher, n) for n in names}

            def refuse(*a, **k):  # type: ignore[no-untyped-def]
                raise AssertionError("host copy, chunk sort or scatter permutation at EP=1")

            for n in names:  # nor use megatron's (scattering) permutation
                setattr(token_dispatcher, n, refuse)
            try:
                got_logits, got_grads = _run(grp, tokens)
            finally:
                for n, f in saved.items():
                    setattr(token_dispatcher, n, f)
            want_grads = _stacked_grads(want_grads)
            scale = want_logits.abs().max().item()
            out[f"logits_{experts}"] = (
                (got_logits - want_logits).abs().max().item() / scale,
                scale,
            )
            worst = 0.0
            assert sorted(got_grads) == sorted(want_grads)
            for name, g in want_grads.items():
                rel = (got_grads[name] - g).abs().max().item() / max(g.abs().max().item(), 1e-12)
                worst = max(worst, rel)
            out[f"grads_{experts}"] = worst
            out[f"empty_{experts}"] = int(min(int(c.min()) for c in counts) == 0)
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
def test_grouped_experts_equal_sequential_mlp() -> None:
    (out,) = run_multiprocess(_worker, 1)
    assert out["types"] == ("GroupedMoELayer", "GroupedExperts", "DeviceCountsDispatcher")
    assert out["sequential_experts"] == "SequentialMLP"
    assert out["init_equal"]
    # What the train.cuda_graph blocker reads: only the per-expert loop waits for the host.
    grouped_sync, sequential_sync, looped_sync = out["host_sync"]
    assert grouped_sync is None
    assert sequential_sync is not None and "model.moe_experts=sequential" in sequential_sync
    # 10 fp32 values a row (40 bytes) are not 16-byte aligned: the grouped experts loop.
    assert looped_sync is not None and "one GEMM per expert" in looped_sync
    for experts in (4, 8):
        rel, scale = out[f"logits_{experts}"]
        worst = out[f"grads_{experts}"]
        assert scale > 0.01  # the comparison has teeth
        assert rel <= TOL, f"{experts} experts: logits differ by {rel:.2e} (relative)"
        assert worst <= TOL, f"{experts} experts: a gradient differs by {worst:.2e}"
    assert out["empty_8"] == 1  # experts without tokens were in the grouped GEMM


def test_looped_fallback_equals_grouped_gemm() -> None:
    from longboat.core.megatron.grouped_experts import (
        group_ends,
        grouped_linear,
        grouped_mm_applies,
        looped_linear,
    )

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 3, 8])
    x = torch.randn(16, 32, generator=g, requires_grad=True)
    w = torch.randn(4, 48, 32, generator=g, requires_grad=True)
    assert grouped_mm_applies(x, w)
    y = grouped_linear(x, w, group_ends(counts, x.device))
    (y * torch.arange(48.0)).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    z = looped_linear(x, w, counts.tolist())
    (z * torch.arange(48.0)).sum().backward()
    assert torch.allclose(y, z, rtol=0, atol=1e-5)
    assert torch.allclose(gx, x.grad, rtol=0, atol=1e-4)
    assert torch.allclose(gw, w.grad, rtol=0, atol=1e-4)
    assert w.grad[1].abs().max() == 0  # the empty expert gets no gradient
    # Rows of 12 fp32 values (48 bytes) are aligned; 10 (40 bytes) are not: the loop runs.
    assert not grouped_mm_applies(torch.randn(4, 10), torch.randn(2, 12, 10))


def test_unknown_moe_experts_value_is_refused() -> None:
    from longboat.core.megatron.specs import resolve_moe_experts

    assert resolve_moe_experts("sequential") == "sequential"
    assert resolve_moe_experts("auto") == "grouped"  # this torch has torch.nn.functional.grouped_mm
    with pytest.raises(ValueError, match="moe_experts='loop'"):
        resolve_moe_experts("loop")


def _cuda_worker(rank: int, world: int) -> dict[str, float]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(ParallelConfig(), get_accelerator("cuda"), seed=1)
    try:
        out: dict[str, float] = {}
        seq, grp = _model("sequential", experts=8), _model("grouped", experts=8)
        _stack_from_sequential(seq, grp)
        seq, grp = (m.to("cuda", torch.bfloat16) for m in (seq, grp))
        moe = grp.decoder.layers[0].mlp

        # No host sync anywhere inside the grouped MoE layer's forward (router, dispatch,
        # grouped GEMMs, combine): the device never waits for the host there.
        def strict(*_):  # type: ignore[no-untyped-def]
            torch.cuda.set_sync_debug_mode("error")

        def relaxed(*_):  # type: ignore[no-untyped-def]
            torch.cuda.set_sync_debug_mode("default")

        moe.register_forward_pre_hook(strict)
        moe.register_forward_hook(relaxed)
        tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(3))
        want_logits, want_grads = _run(seq, tokens.cuda())
        got_logits, got_grads = _run(grp, tokens.cuda())
        want_grads = _stacked_grads(want_grads)
        scale = want_logits.float().abs().max().item()
        out["logits"] = (got_logits.float() - want_logits.float()).abs().max().item() / scale
        out["grads"] = max(
            (got_grads[n].float() - g.float()).abs().max().item() / g.float().abs().max().item()
            for n, g in want_grads.items()
            if g.abs().max() > 0
        )
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_grouped_experts_on_cuda_bf16_match_and_never_sync() -> None:
    """bf16 on CUDA (``torch.nn.functional.grouped_mm``): within bf16 rounding of megatron's
    per-expert loop (2e-2 of each tensor's max: both round every GEMM output to bf16), with
    the MoE layer's forward free of host syncs (``set_sync_debug_mode("error")``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # spawn: the test process may have initialised CUDA already, which a fork cannot inherit
    (out,) = run_multiprocess(_cuda_worker, 1, backend="nccl", timeout=300, start_method="spawn")
    assert out["logits"] <= 2e-2, out
    assert out["grads"] <= 2e-2, out

"""The fused attention-residual add + pre-MLP RMSNorm lever (``LayerKernels.add_rms_norm``).

- on by default in the longboat spec (every layer an ``AddNormTransformerLayer`` that fuses),
  off with ``kernel_options={"add_rms_norm": False}`` (``build_model`` / ``build_train_step``) (megatron's ``TransformerLayer``);
- logits of tiny transformers models (Llama, Qwen3 with qk-norm, Qwen3-MoE) loaded into
  the model match transformers with the lever on and off (fp32, 1e-4 as test_hf_parity),
  and on == off;
- bf16 training steps with and without the fusion agree (losses and weights);
- the Triton kernel in the model under ``TRITON_INTERPRET=1`` == megatron's unfused layer
  (fp32: loss 2e-5, gradients 2e-5 relative) and ran once per layer.

On CPU the kernel dispatches to its torch reference except in the interpreter test.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from llm_testkit import run_interpreted

from longboat.core.distributed import run_multiprocess

HF_TOL = 1e-4  # max |logits - transformers| in fp32, as test_hf_parity
FP32_TOL = 2e-5


def _build(cfg, add_rms_norm: bool, **kw):  # type: ignore[no-untyped-def]
    from longboat.llm import build

    return build.build_model(cfg, kernel_options={"add_rms_norm": add_rms_norm}, **kw)


def _init(seed: int = 1):  # type: ignore[no-untyped-def]
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=seed)
    return parallel_state


# ----------------------------------------------------------------------------- HF parity


def _hf_worker(rank: int, world: int, hf_dir: Path, tokens: torch.Tensor) -> dict[str, object]:
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from pipeline_testkit import forward_logits

    from longboat.core.megatron.specs import AddNormTransformerLayer
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config

    ps = _init()
    try:
        cfg = read_hf_config(hf_dir)
        out: dict[str, object] = {}
        for on in (True, False):
            chunks = _build(cfg, on)
            layers = list(chunks[0].decoder.layers)
            if on:
                out["fused"] = all(
                    isinstance(x, AddNormTransformerLayer) and x.fuses_attention_add for x in layers
                )
            else:
                out["plain"] = all(type(x) is TransformerLayer for x in layers)
            load_hf(chunks, cfg, hf_dir)
            out[on] = forward_logits(chunks, tokens)
        return out
    finally:
        ps.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe"])
def test_logits_match_transformers_with_and_without_the_fusion(
    family: str,
    hf_dirs: dict[str, Path],
    tokens: torch.Tensor,
    reference_logits: dict[str, torch.Tensor],
) -> None:
    (out,) = run_multiprocess(_hf_worker, 1, hf_dirs[family], tokens)
    assert out["fused"] and out["plain"], out
    want = reference_logits[family]
    for on in (True, False):
        diff = (out[on] - want).abs().max().item()
        assert diff <= HF_TOL, f"{family} add_rms_norm={on}: max |logits - hf| = {diff:.3e}"
    # Same adds and norms in fp32, one kernel instead of two: measured bit-identical.
    on_off = (out[True] - out[False]).abs().max().item()
    assert on_off <= 1e-6, f"{family}: fused vs unfused logits differ by {on_off:.3e}"


# ----------------------------------------------------------------------------- training


def _train_worker(rank: int, world: int, fp32_residual: bool) -> dict[str, object]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig
    from longboat.core.family import find_family
    from longboat.llm.train.lm_step import build_train_step

    ps = _init()
    try:
        cfg = find_family("llm", "llama3").flavor("tiny")
        seq = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        out: dict[str, object] = {}
        for on in (True, False):
            model_parallel_cuda_manual_seed(1)
            torch.manual_seed(1)
            ts = build_train_step(
                cfg, OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.0),
                precision="bf16", device="cpu", use_cpu_initialization=True,
                fp32_residual_connection=fp32_residual, kernel_options={"add_rms_norm": on},
            )  # fmt: skip
            out[f"layers_{on}"] = sorted({type(x).__name__ for x in ts.chunks[0].decoder.layers})
            out[f"loss_{on}"] = [float(ts.step(tokens, labels)) for _ in range(5)]
            out[f"w_{on}"] = {n: p.detach().float() for n, p in ts.chunks[0].named_parameters()}
        w_on, w_off = out.pop("w_True"), out.pop("w_False")
        out["weight_diff"] = max(float((w_on[n] - w_off[n]).abs().max()) for n in w_on)
        return out
    finally:
        ps.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("fp32_residual", [False, True], ids=["bf16_stream", "fp32_stream"])
def test_training_steps_agree_with_and_without_the_fusion(fp32_residual: bool) -> None:
    """5 bf16 AdamW steps (lr 3e-3) on a tiny Llama, fused vs megatron's add + norm: the
    losses within 1e-3 of each other and the weights within 1e-3 (bf16 rounding of a 3e-3
    step; the CPU reference of the fused op does the same roundings as the unfused layer,
    measured identical)."""
    (out,) = run_multiprocess(_train_worker, 1, fp32_residual)
    assert out["layers_True"] == ["AddNormTransformerLayer"], out
    assert out["layers_False"] == ["TransformerLayer"], out
    on, off = out["loss_True"], out["loss_False"]
    assert off[-1] < off[0], out  # the steps train
    assert max(abs(a - b) for a, b in zip(on, off)) <= 1e-3, out
    assert out["weight_diff"] <= 1e-3, out


# ----------------------------------------------------------------------------- Triton


TRITON_BODY = textwrap.dedent(
    """
    import longboat.kernels.rmsnorm as rms_mod

    launched = {"add": 0}
    real = rms_mod._AddRMSNormFn.apply
    def counted(*a):
        launched["add"] += 1
        return real(*a)
    rms_mod._AddRMSNormFn.apply = counted
    for precision in sys.argv[1:]:
        launched["add"] = 0
        models = {}
        for on in (True, False):
            (models[on],) = build.build_model(
                cfg, precision=precision, kernel_options={"add_rms_norm": on}
            )
        models[False].load_state_dict(models[True].state_dict())
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
        tokens, labels = seq[:, :-1], seq[:, 1:]
        pos = torch.arange(8).unsqueeze(0).expand(2, -1)
        ref = models[False](tokens, pos, None, labels=labels).float().mean()
        ref.backward()
        gp = dict(models[False].named_parameters())
        scale = max(float(p.grad.float().abs().max()) for p in gp.values())
        fused = models[True](tokens, pos, None, labels=labels).float().mean()
        fused.backward()
        grad = max(
            float((p.grad - gp[n].grad).float().abs().max())
            for n, p in models[True].named_parameters()
        )
        print("RESULT", precision, float(fused), float(ref), grad, scale)
        print("LAUNCHED", precision, launched["add"])
    """
)


# one fresh process importing megatron (~10 s on 2 cores) for both precisions, every kernel in
# Triton's interpreter
def test_triton_add_rmsnorm_in_the_model(tmp_path: Path) -> None:
    """fp32: the fused kernel == megatron's add + the RMSNorm kernel (loss 2e-5, grads 2e-5
    relative; measured identical). bf16: the interpreter rounds the fused kernel's bf16 stream
    toward zero where megatron's torch add rounds to nearest (CUDA rounds to nearest in both),
    so the bound is bf16-sized: loss 2e-3, grads 2^-5 of the largest gradient (measured
    1e-4 and 1%)."""
    pytest.importorskip("triton")
    precisions = ("fp32", "bf16")
    out = run_interpreted(TRITON_BODY, tmp_path / "add_norm_triton.py", *precisions)
    results = {x[0]: [float(v) for v in x[1:]] for x in out["RESULT"]}
    launched = {x[0]: int(x[1]) for x in out["LAUNCHED"]}
    from longboat.core.family import find_family

    num_layers = find_family("llm", "llama3").flavor("tiny").num_layers
    assert sorted(results) == sorted(launched) == sorted(precisions), out
    for precision in precisions:
        assert launched[precision] == num_layers, (precision, launched)
        fused, ref, grad, scale = results[precision]
        loss_tol, grad_tol = (FP32_TOL, FP32_TOL) if precision == "fp32" else (2e-3, 2.0**-5)
        assert abs(fused - ref) <= loss_tol, (precision, fused, ref)
        assert grad <= grad_tol * max(1.0, scale), (precision, grad, scale)

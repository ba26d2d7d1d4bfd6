"""FP8 training of the llm stack on CPU, its GEMMs emulated (dequantise, multiply in fp32).

``build_train_step(..., fp8_recipe=...)`` is the internal switch ``train.precision=fp8`` turns
on; on CPU the FP8 GEMMs run emulated, which the command line never does (it refuses a device
without FP8 matmuls, tested below). A tiny Llama of 4 layers: the middle two layers' 8
linears run in FP8, the first and last layers, LM head and embeddings in bf16.

Tolerance: 8 AdamW steps (lr 3e-3) from the same weights on one batch (the loss falls from
5.53 to 3.82 under bf16), FP8 vs bf16: every step's loss within 0.08 of bf16's and the last
within 0.05 (measured: at most 0.05 on a step, 0.024 at the end, over the three recipes; an
operand rounded to e4m3 / e5m2 is off by a few % against bf16's 2^-9), and the losses differ
from bf16's (the FP8 path ran).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longboat.core.distributed import run_multiprocess

LOSS_TOL = 0.08
FINAL_TOL = 0.05
STEPS = 8


GPU_SHAPE = dict(hidden_size=256, num_attention_heads=4, num_query_groups=2, head_dim=64,
                 ffn_hidden_size=512)  # fmt: skip
"""The GPU test's model: every GEMM dimension a multiple of 128, as cuBLAS's FP8 kernels
like them (the tiny flavor's 64 / 16 are not)."""


def _train_worker(
    rank: int, world: int, recipes: list[str | None], device: str = "cpu"
) -> dict[str, object]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.family import find_family
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.linears import KernelColumnParallelLinear, KernelRowParallelLinear
    from longboat.llm.train.lm_step import build_train_step

    parallel_state.initialize(ParallelConfig(), get_accelerator(device), seed=1)
    try:
        cfg = dataclasses.replace(find_family("llm", "llama3").flavor("tiny"), num_layers=4)
        if device == "cuda":
            cfg = dataclasses.replace(cfg, **GPU_SHAPE)
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(0, cfg.vocab_size, (2, 33 if device == "cpu" else 129), generator=g)
        seq = seq.to(device)
        batches = [(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())] * STEPS  # memorised
        out: dict[str, object] = {}
        for recipe in recipes:
            model_parallel_cuda_manual_seed(1)
            torch.manual_seed(1)
            ts = build_train_step(
                cfg, OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=1.0), precision="bf16",
                device=device, use_cpu_initialization=True, fp8_recipe=recipe,
            )  # fmt: skip
            kinds = (KernelColumnParallelLinear, KernelRowParallelLinear)
            linears = [m for m in ts.chunks[0].modules() if isinstance(m, kinds)]
            on = [m.linear_fn is not None for m in linears]
            fused = ts.chunks[0].config.gradient_accumulation_fusion
            glu_fused = [isinstance(m, KernelRowParallelLinear) and m.fuses_glu() for m in linears]
            out[str(recipe)] = {
                "linears": (sum(on), len(linears)),
                "glu_fused": sum(glu_fused),
                "fusion": bool(fused),
                "loss": [float(ts.step(t, lab)) for t, lab in batches],
            }
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(
                not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                reason="needs an sm90 GPU (blockwise FP8 GEMMs)")],
        ),
    ],
)  # fmt: skip
def test_fp8_training_follows_bf16(device: str) -> None:
    """On CPU the FP8 GEMMs are emulated; on an sm90 GPU they are cuBLAS's (``scaled_mm``)."""
    recipes = [None, "blockwise", "rowwise", "tensorwise"]
    (out,) = run_multiprocess(_train_worker, 1, recipes, device)
    base = out["None"]
    assert base["linears"] == (0, 0), base  # bf16: megatron's linears with the bias epilogue
    assert base["loss"][-1] < base["loss"][0] - 0.1, base  # the steps train
    for recipe in recipes[1:]:
        res = out[recipe]
        assert res["linears"] == (8, 16), (recipe, res)  # layers 2 and 3: qkv, proj, fc1, fc2
        assert res["fusion"], res  # weight gradients through megatron's main_grad hook
        # blockwise: layers 2 and 3's fc2 take the SwiGLU fused in (on CPU its unfused fallback)
        assert res["glu_fused"] == (2 if recipe == "blockwise" else 0), (recipe, res)
        diffs = [abs(a - b) for a, b in zip(res["loss"], base["loss"], strict=True)]
        assert max(diffs) <= LOSS_TOL and diffs[-1] <= FINAL_TOL, (recipe, diffs)
        assert max(diffs) > 0, (recipe, "FP8 losses equal bf16's: the FP8 GEMMs did not run")


def _wiring_worker(rank: int, world: int, precision: str, optim: dict) -> dict[str, object]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.family import find_family
    from longboat.core.megatron import parallel_state
    from longboat.kernels.fp8 import high_precision_linear
    from longboat.llm.train.lm_step import build_train_step

    parallel_state.initialize(ParallelConfig(tensor_parallel=world), get_accelerator("cpu"), seed=1)
    try:
        cfg = find_family("llm", "llama3").flavor("tiny")
        seq = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        out: dict[str, object] = {}
        for name, options in (("kernel", {"linear": high_precision_linear}), ("megatron", None)):
            model_parallel_cuda_manual_seed(1)
            torch.manual_seed(1)
            ts = build_train_step(
                cfg, OptimConfig(**optim), precision=precision, device="cpu",
                use_cpu_initialization=True, kernel_options=options,
            )  # fmt: skip
            out[f"fusion_{name}"] = bool(ts.chunks[0].config.gradient_accumulation_fusion)
            out[f"loss_{name}"] = [float(ts.step(tokens, labels)) for _ in range(4)]
            out[f"w_{name}"] = {n: p.detach().float() for n, p in ts.chunks[0].named_parameters()}
        w_k, w_m = out.pop("w_kernel"), out.pop("w_megatron")
        out["weight_diff"] = max(float((w_k[n] - w_m[n]).abs().max()) for n in w_k)
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "precision,tp,optim,tol",
    [
        # fp32, tensor parallel: a missing input-gradient all-reduce moves weights by ~lr
        ("fp32", 2, {"lr": 1e-2, "weight_decay": 0.0, "grad_clip": 0.0}, 1e-5),
        # bf16, AdamW: weight gradients through megatron's main_grad hook (fusion on)
        ("bf16", 1, {"lr": 3e-3, "weight_decay": 0.1, "grad_clip": 0.0}, 1e-3),
    ],
    ids=["fp32_tp2", "bf16_main_grad"],
)
def test_kernel_linears_reproduce_megatrons(precision: str, tp: int, optim: dict, tol: float) -> None:  # fmt: skip
    """The wiring FP8 runs on (``KernelColumn/RowParallelLinear``), given an exact linear
    (``high_precision_linear``: the same GEMMs in the run's dtype), trains as megatron's own
    linears do: 4 AdamW steps, losses and weights within ``tol`` (fp32: the GEMMs' summation
    order; bf16: one bf16 rounding of a 3e-3 step, as test_add_norm_lever)."""
    ranks = run_multiprocess(_wiring_worker, tp, precision, optim)
    for out in ranks:
        assert out["fusion_kernel"] == out["fusion_megatron"] == (precision == "bf16"), out
        k, m = out["loss_kernel"], out["loss_megatron"]
        assert m[-1] < m[0], out  # the steps train
        assert max(abs(a - b) for a, b in zip(k, m, strict=True)) <= tol, out
        assert out["weight_diff"] <= tol, out


def test_fp8_refused_without_fp8_hardware() -> None:
    from longboat.core.config.errors import ConfigError
    from longboat.core.device import get_accelerator
    from longboat.core.distributed import check_precision_hardware, run_precision

    cpu = get_accelerator("cpu")
    with pytest.raises(ConfigError) as err:
        run_precision("fp8", "fp32", cpu)
    assert err.value.keys == ["train.precision"] and "accelerator (cpu)" in str(err.value)
    check_precision_hardware("bf16", cpu)  # other precisions are not its business


def test_the_command_line_refuses_fp8_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    from longboat.llm.cli import main

    code = main(["train", "experiment=quickstart", "train.precision=fp8", "train.steps=1"])
    text = capsys.readouterr()
    assert code == 2, text
    assert "train.precision='fp8'" in text.err + text.out
    assert "compute capability 8.9" in text.err + text.out


def test_fp8_keys_compose_and_conflicts_are_refused() -> None:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.config.errors import ConfigError

    cfg = compose_experiment(
        "quickstart", ["train.precision=fp8", "train.fp8.recipe=adaptive"], stack="llm"
    )
    assert cfg.train.precision == "fp8" and cfg.train.fp8.recipe == "adaptive"
    assert compose_experiment("quickstart", [], stack="llm").train.fp8.recipe == "blockwise"
    cases = {
        "train.fp8.recipe": ["train.precision=fp8", "train.fp8.recipe=delayed"],
        "train.compile": ["train.precision=fp8", "train.compile=true"],
        "model.layer_backend": ["train.precision=fp8", "model.layer_backend=te"],
    }
    for key, overrides in cases.items():
        with pytest.raises(ConfigError) as err:
            compose_experiment("quickstart", overrides, stack="llm")
        assert key in err.value.keys, (key, err.value)


def test_resume_refuses_another_recipe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from longboat.core.checkpoint.errors import CheckpointError
    from longboat.core.train.resume import check_precision_resume

    def cfg(precision: str, recipe: str = "blockwise", allow: bool = False) -> dict:
        return {"train": {"precision": precision,
                          "fp8": {"recipe": recipe, "allow_recipe_change": allow}}}  # fmt: skip

    with pytest.raises(
        CheckpointError, match=r"fp8 \(blockwise\); this run asks for fp8 \(rowwise\)"
    ):
        check_precision_resume(tmp_path, cfg("fp8"), cfg("fp8", "rowwise"))
    with pytest.raises(CheckpointError, match="allow_recipe_change"):
        check_precision_resume(tmp_path, cfg("bf16"), cfg("fp8"))
    with pytest.raises(CheckpointError, match=r"fp8 \(tensorwise\); this run asks for bf16"):
        check_precision_resume(tmp_path, cfg("fp8", "tensorwise"), cfg("bf16"))
    check_precision_resume(tmp_path, cfg("fp8"), cfg("fp8", "rowwise", allow=True))
    check_precision_resume(tmp_path, cfg("fp8"), cfg("fp8"))
    check_precision_resume(tmp_path, cfg("bf16", "rowwise"), cfg("fp32"))  # no FP8 involved
    check_precision_resume(tmp_path, {"train": {}}, cfg("fp8"))  # no precision recorded


MOE_STEPS = 6


def _moe_worker(rank: int, world: int, family: str, runs: list[tuple[str | None, bool]]) -> dict:
    """Train a 4-layer tiny MoE ``family`` for each ``(recipe, experts_fp8)`` of ``runs`` from the
    same weights; ``experts_fp8=False`` puts the grouped experts back on the bf16 GEMM."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.family import find_family
    from longboat.core.megatron import parallel_state
    from longboat.core.megatron.grouped_experts import GroupedExperts
    from longboat.llm.train.lm_step import build_train_step

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        cfg = dataclasses.replace(find_family("llm", family).flavor("tiny"), num_layers=4)
        seq = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
        tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        out: dict[str, object] = {}
        for recipe, experts_fp8 in runs:
            model_parallel_cuda_manual_seed(1)
            torch.manual_seed(1)
            ts = build_train_step(
                cfg, OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=1.0), precision="bf16",
                device="cpu", use_cpu_initialization=True, fp8_recipe=recipe,
            )  # fmt: skip
            experts = [m for m in ts.chunks[0].modules() if isinstance(m, GroupedExperts)]
            if not experts_fp8:
                for m in experts:
                    m.grouped_linear_fn = None
            out[f"{recipe}/{experts_fp8}"] = {
                "experts": (sum(m.grouped_linear_fn is not None for m in experts), len(experts)),
                "loss": [float(ts.step(tokens, labels)) for _ in range(MOE_STEPS)],
            }
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "family,fp8_experts", [("qwen3_moe", (2, 4)), ("deepseek_v3", (2, 3))]
)  # fmt: skip
def test_moe_fp8_runs_grouped_experts_in_fp8(family: str, fp8_experts: tuple[int, int]) -> None:
    """``train.precision=fp8`` on an MoE model: the middle layers' grouped experts run their
    GEMMs in FP8 (per-expert scales; the first and last layers' experts, the router and the
    dense layer in bf16), the loss follows bf16's within the dense test's tolerances (6 steps,
    measured: at most 0.021 on a step over blockwise, rowwise and tensorwise), and the expert
    GEMMs' FP8 changes the losses against the same run with bf16 experts (the FP8 expert path
    ran)."""
    runs = [(None, False), ("blockwise", True), ("rowwise", True), ("blockwise", False)]
    (out,) = run_multiprocess(_moe_worker, 1, family, runs)
    base = out["None/False"]["loss"]
    assert out["None/False"]["experts"] == (0, fp8_experts[1]), out
    assert base[-1] < base[0] - 0.1, out  # the steps train
    for recipe in ("blockwise", "rowwise"):
        res = out[f"{recipe}/True"]
        assert res["experts"] == fp8_experts, (recipe, res)
        diffs = [abs(a - b) for a, b in zip(res["loss"], base, strict=True)]
        assert max(diffs) <= LOSS_TOL and diffs[-1] <= FINAL_TOL, (recipe, diffs)
    dense_only = out["blockwise/False"]["loss"]
    assert dense_only != out["blockwise/True"]["loss"], "the FP8 expert GEMMs did not run"

"""Low-memory optimizer storage of the master-weight AdamW (``optim.moment_dtype=bf16``,
``train.master_weight_storage=bf16_sr``): the exact update rule against the fp32-storage
optimizer on the same grads, the slices against the one-pass update, and bit-exact resume
through state dicts and core's DCP checkpoints (CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from embodied_testkit import SETUP, cpu_train_step, tiny_groot
from test_parallel_master_weights import _dcp_load, _dcp_save, _fixed_grad, _tie_params

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import OptimConfig
from longboat.core.engine.torch import master_weights as mw_module
from longboat.core.engine.torch.stochastic_round import step_key, stochastic_round_
from longboat.embodied.models import apply_freezing, build_model
from longboat.embodied.models.synthetic import synthetic_batch
from longboat.embodied.parallel import MasterWeightAdamW, build_optimizer

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], grad_clip=1.0)

pytestmark = pytest.mark.usefixtures("one_thread")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _optimizer(storage: str, moments: torch.dtype, impl: str | None = None, seed: int = 0):
    """The tie params (rounded to bf16 first, so every storage starts from the same
    values), two groups, a CHUNK small enough for several slices per group."""
    params = _tie_params(0)
    for p in params:
        p.data = p.data.to(torch.bfloat16).float()
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return MasterWeightAdamW(groups, lr=1e-2, betas=(0.9, 0.95), master_storage=storage,
                             moment_dtype=moments, kernel_impl=impl, seed=seed)  # fmt: skip


def _step(opts, grad: torch.Tensor, clip: float = 0.5) -> None:
    for opt in opts:
        opt.flat_grad.copy_(grad)
        opt.prepare_grads(clip)
        opt.step()


def test_one_step_is_the_fp32_update_rounded(monkeypatch) -> None:
    # From the same bf16-exact start, one step of each storage is fp32 storage's step with
    # its results rounded: bf16 moments to nearest even, bf16_sr weights stochastically with
    # the noise of (seed, step 1, flat index); exact, on both update paths.
    monkeypatch.setattr(mw_module, "CHUNK", 512)
    for impl in (None, "torch"):
        ref = _optimizer("fp32", torch.float32, impl)
        low = _optimizer("fp32", torch.bfloat16, impl)
        sr = _optimizer("bf16_sr", torch.bfloat16, impl, seed=7)
        assert sr._master is None and sr.master_lo is None and sr.exp_avg.dtype == torch.bfloat16
        assert sum(len(c) for c in sr._chunks) > 5
        assert torch.equal(_bits(sr.flat_param), _bits(ref.flat_param))
        _step((ref, low, sr), _fixed_grad(ref, torch.Generator().manual_seed(5), 0.3))
        for opt in (low, sr):
            for name in ("exp_avg", "exp_avg_sq"):
                want = getattr(ref, name).to(torch.bfloat16)
                assert torch.equal(_bits(getattr(opt, name)), _bits(want)), (impl, name)
        assert torch.equal(_bits(low.master), _bits(ref.master))
        key = step_key(7, torch.tensor(1.0))
        want = stochastic_round_(ref.master, torch.empty_like(sr.flat_param), key, 0)
        assert torch.equal(_bits(sr.flat_param), _bits(want)), impl
        # stochastic: not what round-to-nearest gives everywhere
        assert (_bits(sr.flat_param) != _bits(ref.flat_param)).any()


def test_slices_and_one_pass_update_agree(monkeypatch) -> None:
    # Same storage, the fused-AdamW slices vs the one-pass update (torch reference): the
    # fp32 math agrees to ~1e-6, so over 4 steps (a clipped one, a skipped non-finite one)
    # the bf16 buffers agree but for rare roundings one ulp apart.
    monkeypatch.setattr(mw_module, "CHUNK", 512)
    slices = _optimizer("bf16_sr", torch.bfloat16, None, seed=3)
    kernel = _optimizer("bf16_sr", torch.bfloat16, "torch", seed=3)
    g = torch.Generator().manual_seed(8)
    for step in range(4):
        grad = _fixed_grad(slices, g, 0.3)
        if step == 2:
            grad[5] = float("inf")
        before = slices.flat_param.clone()
        _step((slices, kernel), grad, 0.5 if step % 2 else 0.0)
        if step == 2:  # skipped: nothing moved
            assert torch.equal(_bits(slices.flat_param), _bits(before))
        for name in ("flat_param", "exp_avg", "exp_avg_sq"):
            a, b = _bits(getattr(slices, name)).int(), _bits(getattr(kernel, name)).int()
            assert int((a - b).abs().max()) <= 1 and int((a != b).sum()) <= a.numel() // 100
    assert float(slices.step_count) == float(kernel.step_count) == 3


def _groot(storage: str, moment_dtype: str):
    optim = dataclasses.replace(OPTIM, moment_dtype=moment_dtype)
    torch.manual_seed(0)
    model, opt = tiny_groot(optim, storage=storage)
    return model, opt


def _run(model, opt, batches, start=0):
    return [
        (float(r.loss), float(r.grad_norm))
        for r in (
            cpu_train_step(model, opt, b, s, OPTIM.grad_clip) for s, b in enumerate(batches, start)
        )
    ]


@pytest.mark.parametrize(
    "storage,moments", [("bf16_sr", "bf16"), ("split", "bf16"), ("bf16_sr", "fp32")]
)
def test_resume_through_dcp_checkpoints_is_bit_exact(tmp_path: Path, storage, moments) -> None:
    # 2 steps, core's DCP checkpoint, a fresh model + optimizer, 2 more steps: bit for bit the
    # uninterrupted 4 steps (losses, grad norms, weights, moments): the noise of bf16_sr
    # comes from (seed, step, index), so the restored step count is all it needs.
    torch.manual_seed(1)
    batches = [synthetic_batch(build_model("groot_n1_6", "tiny"), 2) for _ in range(4)]
    model, opt = _groot(storage, moments)
    assert opt.master_storage == storage
    assert opt.exp_avg.dtype == (torch.bfloat16 if moments == "bf16" else torch.float32)
    full = _run(model, opt, batches)
    full_state = [opt.flat_param.clone(), opt.exp_avg.clone(), opt.exp_avg_sq.clone()]
    model, opt = _groot(storage, moments)
    first = _run(model, opt, batches[:2])
    sd = opt.state_dict()["state"][0]
    assert sd["exp_avg"].dtype == opt.exp_avg.dtype and sd["master"].dtype == torch.float32
    _dcp_save(tmp_path / "ckpt", model, opt)
    model2, opt2 = _groot(storage, moments)
    _dcp_load(tmp_path / "ckpt", model2, opt2)
    assert float(opt2.step_count) == 2
    second = _run(model2, opt2, batches[2:], start=2)
    assert first + second == full
    for got, want in zip((opt2.flat_param, opt2.exp_avg, opt2.exp_avg_sq), full_state):
        assert torch.equal(_bits(got), _bits(want))


def test_low_memory_steps_are_capturable() -> None:
    from longboat.core.loop.capture_check import find_capture_hazards

    for impl in (None, "torch"):
        opt = _optimizer("bf16_sr", torch.bfloat16, impl, seed=5)
        opt.flat_grad.normal_()
        opt.prepare_grads(1.0)
        opt.sync_hyperparams()
        assert find_capture_hazards(opt.step_on_device) == [], impl


def test_bf16_sr_is_seeded() -> None:
    # Another seed, other roundings; the same seed, the same run.
    grad = None
    outs = []
    for seed in (1, 1, 2):
        opt = _optimizer("bf16_sr", torch.float32, seed=seed)
        grad = _fixed_grad(opt, torch.Generator().manual_seed(4), 0.3) if grad is None else grad
        _step((opt,), grad)
        outs.append(_bits(opt.flat_param).clone())
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_bad_storage_keys_are_config_errors() -> None:
    model = build_model("groot_n1_6", "tiny")
    apply_freezing(model)
    bad = dataclasses.replace(OPTIM, moment_dtype="fp16")
    with pytest.raises(ConfigError, match=r"optim\.moment_dtype"):
        build_optimizer(model, bad, SETUP, master_weights=True)
    bf16 = dataclasses.replace(OPTIM, moment_dtype="bf16")
    with pytest.raises(ConfigError, match=r"optim\.moment_dtype") as err:
        build_optimizer(model, bf16, SETUP, master_weights=False)
    assert "train.master_weights=true" in str(err.value)
    with pytest.raises(ValueError, match="moment_dtype"):
        MasterWeightAdamW([{"params": list(model.parameters())[:1]}], lr=1e-3,
                          moment_dtype=torch.float16)  # fmt: skip


def test_trainer_resume_with_bf16_sr_and_bf16_moments_is_bit_exact(tmp_path: Path) -> None:
    """The trainer's checkpoint path (as ``test_train_resume``'s master-weight test): a run
    with both storage changes pinned, resumed from its step-2 checkpoint in another
    directory, continues the exact loss curve (the rounding noise is a function of the
    restored step count)."""
    import shutil

    from test_train_resume import KILL_AFTER_CHECKPOINT, STEPS, _overrides

    from longboat.core.config.compose import compose_experiment
    from longboat.embodied.train.trainer import train

    extra = ["train.precision=bf16", "train.master_weights=true", "optim.moment_dtype=bf16",
             "train.master_weight_storage=bf16_sr"]  # fmt: skip
    straight = tmp_path / "straight"
    compose = lambda out, data: compose_experiment(  # noqa: E731
        "groot_n1_6_tiny", [*_overrides(out, data), *extra], world_size=1
    )
    reference = train(compose(straight, None)).losses
    moved = tmp_path / "moved"
    ckpt = f"step_{KILL_AFTER_CHECKPOINT:08d}"
    shutil.copytree(straight / "checkpoints" / ckpt, moved / "checkpoints" / ckpt)
    result = train(compose(moved, straight / "dataset"))
    assert result.start_step == KILL_AFTER_CHECKPOINT
    assert len(set(reference)) == STEPS
    assert result.losses == reference[KILL_AFTER_CHECKPOINT:]


def test_storage_keys_need_the_master_weight_optimizer(tmp_path: Path) -> None:
    from longboat.core.config.compose import compose_experiment

    base = [f"output_dir={tmp_path}", "train.precision=bf16"]
    cfg = compose_experiment("groot_n1_6_tiny", [*base, "optim.moment_dtype=bf16",
                                                 "train.master_weight_storage=bf16_sr"])  # fmt: skip
    assert (cfg.optim.moment_dtype, cfg.train.master_weight_storage) == ("bf16", "bf16_sr")
    for key, value in (("optim.moment_dtype", "bf16"), ("train.master_weight_storage", "bf16_sr")):
        with pytest.raises(ConfigError) as err:
            compose_experiment("groot_n1_6_tiny", [*base, "train.master_weights=false",
                                                   f"{key}={value}"])  # fmt: skip
        assert err.value.keys == [key] and "train.master_weights=true" in str(err.value)

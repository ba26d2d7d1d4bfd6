"""``optim.moment_dtype=bf16`` on the megatron engine: AdamW's moments kept in bf16 by the
one-pass update, its numerics against the kernels' torch reference and torch's AdamW, the
checkpoint round trip and resume, and the refusals where megatron's step would run."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from llm_testkit import compose, make_tiny_dataset, tiny_overrides

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess


def _tiny_cfg():
    from longboat.core.family import find_family

    return find_family("llm", "llama3").flavor("tiny")


def _batch(cfg, seed: int, b: int = 2, s: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(
        0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed)
    )
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _init():
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    return parallel_state


def _build(moments: str | None, *, clip: float = 0.0, precision: str = "bf16", one_pass=True):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig
    from longboat.llm.train.lm_step import build_train_step

    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    optim = OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=clip, moment_dtype=moments)
    return build_train_step(_tiny_cfg(), optim, precision=precision, device="cpu",
                            use_cpu_initialization=True, one_pass_adamw=one_pass)  # fmt: skip


def _states(ts):
    return [
        (part.optimizer, shard, part.optimizer.state[shard.main])
        for part, shards, _ in ts.one_pass.plans
        for shard in shards
    ]


# ----------------------------------------------------------------------------- the update


def _update_worker(rank: int, world: int, clip: float) -> dict[str, object]:
    from longboat.kernels.adamw import adamw_master_step_torch_
    from longboat.llm.train.megatron_schedule import forward_backward

    ps = _init()
    try:
        ts = _build("bf16", clip=clip)
        op = ts.one_pass
        states = _states(ts)
        before = {
            "dtypes": sorted({str(s[k].dtype) for _, _, s in states for k in ("exp_avg", "exp_avg_sq")}),
            "zero": all(float(s["exp_avg"].abs().sum()) == 0.0 for _, _, s in states),
            "steps": sorted({float(s["step"]) for _, _, s in states}),
        }  # fmt: skip
        exact, main_rel, moment_rel = True, 0.0, 0.0
        for i in range(4):
            tokens, labels = _batch(_tiny_cfg(), seed=i)
            ts.optimizer.zero_grad()
            forward_backward(ts.model, [ts.batch(tokens, labels)], fused_ce=True)
            scale = None
            if clip:
                scale = torch.clamp((op.device_grad_norm() + 1e-6) / clip, min=1.0)
            refs = []
            for inner, shard, st in states:
                grp = inner.param_groups[shard.group]
                lr = torch.tensor(float(grp["lr"]))
                b1, b2 = (float(b) for b in grp["betas"])
                hyper = {"beta1": b1, "beta2": b2, "eps": float(grp["eps"]),
                         "weight_decay": float(grp["weight_decay"])}  # fmt: skip
                # The kernels' torch reference on copies, bf16 moments.
                master, m, v = shard.main.clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()
                out = None if shard.out is None else shard.out.clone()
                adamw_master_step_torch_(master, shard.grad, m, v, out, lr=lr,
                                         step=st["step"] + 1, grad_scale=scale, **hyper)  # fmt: skip
                # torch's AdamW on fp32 copies of the same state, its moments then rounded.
                p = torch.nn.Parameter(shard.main.clone())
                g = shard.grad.float()
                p.grad = g / scale if scale is not None else g
                adamw = torch.optim.AdamW([p], lr=float(grp["lr"]), betas=(b1, b2),
                                          eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                                          foreach=False)  # fmt: skip
                adamw.state[p] = {"step": st["step"].clone(),
                                  "exp_avg": st["exp_avg"].float(),
                                  "exp_avg_sq": st["exp_avg_sq"].float()}  # fmt: skip
                adamw.step()
                refs.append((master, m, v, out, p.detach(), adamw.state[p]))
            assert op.step()
            for (_, shard, st), (master, m, v, out, p, ref) in zip(states, refs, strict=True):
                exact &= torch.equal(shard.main, master)
                exact &= torch.equal(st["exp_avg"], m) and torch.equal(st["exp_avg_sq"], v)
                exact &= out is None or torch.equal(shard.out, out)
                exact &= st["exp_avg"].dtype == torch.bfloat16
                scale_p = max(float(p.abs().max()), 1e-12)
                main_rel = max(main_rel, float((shard.main - p).abs().max()) / scale_p)
                for key in ("exp_avg", "exp_avg_sq"):
                    r = ref[key]
                    err = float((st[key].float() - r).abs().max()) / max(
                        float(r.abs().max()), 1e-30
                    )
                    moment_rel = max(moment_rel, err)
        moved = max(float(s["exp_avg"].float().abs().max()) for _, _, s in states)
        return {**before, "exact": exact, "main_rel": main_rel, "moment_rel": moment_rel,
                "moved": moved, "after_steps": sorted({float(s["step"]) for _, _, s in states})}  # fmt: skip
    finally:
        ps.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["no_clip", "clip"])
def test_bf16_moment_update_is_the_reference_update(clip: float) -> None:
    (out,) = run_multiprocess(_update_worker, 1, clip)
    # Allocated in bf16 before the first step, zero, step count 0.
    assert out["dtypes"] == ["torch.bfloat16"] and out["zero"] and out["steps"] == [0.0], out
    # Every step: bit for bit the kernels' torch reference with bf16 moments (main weight,
    # both moments, the bf16 weight written to the param buffer), moments still bf16.
    assert out["exact"], out
    assert out["after_steps"] == [4.0] and out["moved"] > 0.0, out
    # And torch's AdamW on fp32 copies of the same state: the same main weight up to op
    # order, its fp32 moments within bf16's rounding of ours (2**-8 relative).
    assert out["main_rel"] <= 1e-6, out
    assert out["moment_rel"] <= 2.0**-8, out


def _loss_worker(rank: int, world: int) -> dict[str, list[float]]:
    ps = _init()
    try:
        losses = {}
        for moments in ("fp32", "bf16"):
            ts = _build(moments, clip=1.0)
            losses[moments] = [float(ts.step(*_batch(_tiny_cfg(), seed=i % 4))) for i in range(16)]
        return losses
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_bf16_moments_train_like_fp32_moments() -> None:
    """16 steps of the tiny Llama (bf16 weights, lr 3e-3, clipping at 1.0, 4 batches
    repeated): the loss curves with bf16 and fp32 moments agree within 0.03 (measured
    0.012 at most, on CPU) and both fall."""
    (out,) = run_multiprocess(_loss_worker, 1)
    fp32, bf16 = out["fp32"], out["bf16"]
    assert fp32 != bf16  # the storage changes numerics
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) <= 0.03, out
    assert bf16[-1] < bf16[0] - 0.5 and fp32[-1] < fp32[0] - 0.5, out


# ----------------------------------------------------------------------------- checkpoints


def _saved(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)  # what the checkpoint's per-rank file holds
    return buf.getvalue()


def _loaded(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def _checkpoint_worker(rank: int, world: int) -> dict[str, object]:
    from longboat.core.megatron.optimizer import MegatronOptimizerState

    ps = _init()
    try:
        src = {m: _build(m) for m in ("bf16", "fp32")}
        for ts in src.values():
            for i in range(2):
                ts.step(*_batch(_tiny_cfg(), seed=i))
        saved = {m: _saved(MegatronOptimizerState(ts.optimizer).state_dict())
                 for m, ts in src.items()}  # fmt: skip
        wanted = {m: [{k: v.clone() for k, v in s.items()} for _, _, s in _states(ts)]
                  for m, ts in src.items()}  # fmt: skip
        first = next(iter(_loaded(saved["bf16"])["optimizers"][0]["state"].values()))
        out: dict[str, object] = {"saved_dtype": str(first["exp_avg"].dtype)}
        for ckpt, run in (("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "bf16")):
            ts = _build(run)
            MegatronOptimizerState(ts.optimizer).load_state_dict(_loaded(saved[ckpt]))
            want = wanted[ckpt]
            got = [s for _, _, s in _states(ts)]
            dtype = torch.bfloat16 if run == "bf16" else torch.float32
            out[f"{ckpt}->{run}"] = all(
                g[k].dtype == dtype and torch.equal(g[k], w[k].to(dtype))
                for g, w in zip(got, want, strict=True)
                for k in ("exp_avg", "exp_avg_sq")
            ) and all(torch.equal(g["step"], w["step"]) for g, w in zip(got, want))
            if ckpt == run:  # the same run continues bit for bit (the model's weights are
                # the checkpoint's other half)
                a, b = src[ckpt], ts
                with torch.no_grad():
                    for x, y in zip(b.chunks[0].parameters(), a.chunks[0].parameters()):
                        x.copy_(y)
                tokens, labels = _batch(_tiny_cfg(), seed=7)
                out["continues"] = float(a.step(tokens, labels)) == float(b.step(tokens, labels))
                out["continues"] &= all(
                    torch.equal(x, y) for x, y in zip(a.chunks[0].parameters(), b.chunks[0].parameters())
                )  # fmt: skip
        return out
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_bf16_moments_checkpoint_round_trip_and_conversion() -> None:
    (out,) = run_multiprocess(_checkpoint_worker, 1)
    assert out["saved_dtype"] == "torch.bfloat16", out  # saved as bf16, not upcast
    # Loaded into the run's moment dtype: bf16 bit for bit, bf16 -> fp32 exactly,
    # fp32 -> bf16 rounded to nearest (the documented conversion); step counts kept.
    assert out["bf16->bf16"] and out["bf16->fp32"] and out["fp32->bf16"], out
    assert out["continues"], out


def _stop_at_worker(rank: int, world: int, overrides: list[str], stop_at: int):
    import os
    import signal

    from longboat.llm.train.training import train as run

    def on_step(step: int) -> None:
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

    result = run(compose(overrides, world_size=world), on_step=on_step if stop_at else None)
    return result.start_step, result.losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2], ids=["dp1", "dp2"])
def test_resume_with_bf16_moments_is_exact(world: int, tmp_path: Path) -> None:
    """8 steps straight vs 4 + resume with optim.moment_dtype=bf16 (one rank, and the
    distributed optimizer's state sharded over two data-parallel ranks): the same losses on
    every rank, and each rank's checkpoint file holds its bf16 moments."""
    data, tok = make_tiny_dataset(tmp_path / "data")

    def overrides(out: Path) -> list[str]:
        return [*tiny_overrides(data, tok, out, steps=8), "checkpoint.resume=auto",
                "checkpoint.save_on_exit=true", "optim.moment_dtype=bf16"]  # fmt: skip

    ref = run_multiprocess(_stop_at_worker, world, overrides(tmp_path / "ref"), 0)
    assert all(start == 0 and len(losses) == 8 for start, losses in ref)
    first = run_multiprocess(_stop_at_worker, world, overrides(tmp_path / "run"), 4)
    assert all(start == 0 and len(losses) == 4 for start, losses in first)
    for rank in range(world):
        extras = torch.load(tmp_path / "run" / "ckpt" / "step_00000004" / f"extra_rank{rank}.pt",
                            weights_only=True)  # fmt: skip
        state = extras["optimizer"]["optimizers"][0]["state"]
        dtypes = {str(s[k].dtype) for s in state.values() for k in ("exp_avg", "exp_avg_sq")}
        assert dtypes == {"torch.bfloat16"}, (rank, dtypes)
    resumed = run_multiprocess(_stop_at_worker, world, overrides(tmp_path / "run"), 0)
    for (start, losses), (_, ref_losses) in zip(resumed, ref, strict=True):
        assert start == 4
        assert losses == ref_losses[4:], "resumed losses differ from the uninterrupted run"


# ----------------------------------------------------------------------------- refusals


def _refusal_worker(rank: int, world: int) -> list[str]:
    ps = _init()
    try:
        keys = []
        try:
            _build("bf16", one_pass=False)
        except ConfigError as exc:
            keys.append(f"{exc.keys[0]}: {exc}")
        return keys
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_bf16_moments_without_the_one_pass_update_are_refused_at_build() -> None:
    (msgs,) = run_multiprocess(_refusal_worker, 1)
    assert len(msgs) == 1 and msgs[0].startswith("optim.moment_dtype: "), msgs
    assert "optim.one_pass_adamw=false" in msgs[0], msgs


@pytest.mark.parametrize(
    ("keys", "why"),
    [
        (["optim.one_pass_adamw=false"], "optim.one_pass_adamw=false"),
        (["optim.name=sgd"], "optim.name=sgd"),
        (["train.precision=fp16"], "train.precision=fp16"),
    ],
    ids=["megatron_step", "sgd", "fp16"],
)
def test_bf16_moments_are_refused_before_work_where_megatrons_step_runs(
    keys: list[str], why: str, tmp_path: Path
) -> None:
    data, tok = make_tiny_dataset(tmp_path / "data")
    base = [*tiny_overrides(data, tok, tmp_path / "run"), "optim.moment_dtype=bf16"]
    with pytest.raises(ConfigError) as err:
        compose([*base, *keys])
    assert "optim.moment_dtype" in err.value.keys, err.value
    assert why in str(err.value), err.value
    assert compose(base).optim.moment_dtype == "bf16"  # accepted where the update keeps it


def test_bf16_moments_blocker_names_expert_parallel_clipping() -> None:
    from longboat.core.megatron.engine.moments import bf16_moments_blocker

    ok = {"optimizer": "adamw", "one_pass_adamw": True, "precision": "bf16", "grad_clip": 1.0}
    assert bf16_moments_blocker(**ok) is None
    assert bf16_moments_blocker(**ok, expert_parallel=4) is not None
    assert "expert_parallel" in bf16_moments_blocker(**ok, expert_parallel=4)
    assert bf16_moments_blocker(**{**ok, "grad_clip": 0.0}, expert_parallel=4) is None


# ----------------------------------------------------------------------------- captured step


def _hazards_worker(rank: int, world: int) -> list[tuple[str, str]]:
    from longboat.core.loop.capture_check import capture_hazards

    ps = _init()
    try:
        ts = _build("bf16", clip=1.0)
        tokens, labels = _batch(_tiny_cfg(), seed=0)
        ts.step(tokens, labels)
        with capture_hazards() as found:
            ts.step(tokens, labels)
        return [(h.op, h.where.split("/")[-1]) for h in found]
    finally:
        ps.destroy()


@pytest.mark.multiprocess
def test_the_bf16_moment_update_has_no_capture_hazards() -> None:
    """The clipped one-pass update on bf16 moments reads nothing on the host (core's
    capture_check sees every aten op on CPU): a CUDA graph can capture it."""
    (found,) = run_multiprocess(_hazards_worker, 1)
    assert found == [], found


def _cuda_worker(rank: int, world: int) -> dict[str, object]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.llm.train.lm_step import build_train_step

    torch.cuda.set_device(0)
    acc = get_accelerator("cuda")
    parallel_state.initialize(ParallelConfig(), acc, seed=1)
    try:
        cfg = _tiny_cfg()
        tokens, labels = (t.cuda() for t in _batch(cfg, seed=0, s=64))
        out: dict[str, object] = {}
        for moments in ("fp32", "bf16"):
            model_parallel_cuda_manual_seed(1)
            torch.manual_seed(1)
            optim = OptimConfig(lr=1e-3, grad_clip=1.0, moment_dtype=moments)
            ts = build_train_step(cfg, optim, precision="bf16", device="cuda", cuda_graph=True,
                                  one_pass_adamw=True)  # fmt: skip
            step = ts.graphed(acc, warmup=2)
            out[moments] = [float(step(tokens, labels)) for _ in range(8)]
            out[f"{moments}_graph"] = (step.graph.reason, step.graph.replays)
            out[f"{moments}_dtypes"] = sorted({str(s[k].dtype) for _, _, s in _states(ts)
                                               for k in ("exp_avg", "exp_avg_sq")})  # fmt: skip
        return out
    finally:
        parallel_state.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_bf16_moment_steps_on_cuda() -> None:
    """The whole step as one CUDA graph with the Triton one-pass update on bf16 moments:
    captured, moments still bf16, and the curve within bf16 noise of fp32 moments (8 steps)."""
    (out,) = run_multiprocess(_cuda_worker, 1, backend="nccl", timeout=300, start_method="spawn")
    for moments in ("fp32", "bf16"):
        reason, replays = out[f"{moments}_graph"]
        assert reason is None and replays >= 6, out
    assert out["bf16_dtypes"] == ["torch.bfloat16"] and out["fp32_dtypes"] == ["torch.float32"]
    assert out["bf16"][-1] < out["bf16"][0], out
    assert all(abs(a - b) <= 3e-2 for a, b in zip(out["fp32"], out["bf16"])), out

"""The torch step engine (``longboat.core.engine.torch``) on a plain toy ``nn.Module``: gradient
accumulation equals one big batch, the master-weight update equals fp32 AdamW, the lagged NaN
gate skips exactly like the synchronous one, recompute and the gate choice, and a 2-process
gloo DDP / FSDP2 run equals one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from longboat.core.config.schema import LRScheduleConfig, NaNGuardConfig, OptimConfig
from longboat.core.device import get_accelerator
from longboat.core.distributed import run_multiprocess
from longboat.core.engine.torch import engine
from longboat.core.engine.torch.graphable import GraphableStep, LaggedGuard, run_step
from longboat.core.engine.torch.master_weights import MasterWeightAdamW
from longboat.core.engine.torch.optim import build_optimizer, param_groups
from longboat.core.engine.torch.step import train_step
from longboat.core.engine.torch.strategy import ParallelSetup, parallelize, unwrap
from longboat.core.loop.nan_guard import NaNGuard
from longboat.core.train.gate import UpdateGate
from longboat.core.train.schedule import RunSchedule

WIDTH = 8


class _Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.nn.functional.gelu(self.fc(h)))


class ToyRegressor(nn.Module):
    """Three residual blocks and a linear head; ``model(batch)`` -> ``{"loss", "mae"}``."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(dropout) for _ in range(3)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = batch["x"]
        for block in self.blocks:
            h = block(h)
        err = self.head(h).squeeze(-1).float() - batch["y"]
        return {"loss": err.pow(2).mean(), "mae": err.abs().mean()}


def _toy(seed: int = 0, dropout: float = 0.0) -> ToyRegressor:
    torch.manual_seed(seed)
    return ToyRegressor(dropout)


def _batches(steps: int, rows: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(rows, WIDTH, generator=g), "y": torch.randn(rows, generator=g)}
        for _ in range(steps)
    ]


def _split(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    return [dict(zip(batch, values)) for values in zip(*(v.chunk(parts) for v in batch.values()))]


OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], grad_clip=0.5, fused=False)
SINGLE = ParallelSetup(strategy="ddp", world_size=1, rank=0)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in unwrap(model).parameters()])


# ---------------------------------------------------------------- gradient accumulation


def test_gradient_accumulation_equals_one_big_batch() -> None:
    # 4 micro-batches of 2 rows accumulated vs 1 batch of 8 rows, fp32 AdamW with clipping:
    # the same mean loss and metric, grad norm and weights after 3 steps (float64 loss sums;
    # the grads differ only in summation order: 1e-6 relative).
    runs = []
    for parts in (4, 1):
        model = _toy()
        opt = build_optimizer(model, OPTIM, SINGLE)
        out = []
        for step, batch in enumerate(_batches(3, 8)):
            r = train_step(
                model,
                opt,
                _split(batch, parts),
                step=step,
                seed=5,
                rank_offset=0,
                device_type="cpu",
                grad_clip=OPTIM.grad_clip,
            )
            out.append((r.loss, r.grad_norm, r.metrics["mae"]))
        runs.append((out, _flat(model)))
    (acc, acc_w), (big, big_w) = runs
    assert torch.allclose(torch.tensor(acc), torch.tensor(big), rtol=1e-6, atol=0)
    assert acc[0][1] > OPTIM.grad_clip  # the clip took effect on the first step
    torch.testing.assert_close(acc_w, big_w, rtol=1e-6, atol=1e-7)
    assert not torch.equal(acc_w, _flat(_toy()))  # it trained


# ---------------------------------------------------------------- master weights


def test_master_weight_update_equals_fp32_adamw() -> None:
    # The same grads (bf16 values, as the bf16 backward writes them) into MasterWeightAdamW
    # and into torch's fp32 AdamW on an fp32 copy, clipped to 0.5 on the device vs
    # clip_grad_norm_: masters within 1e-6 relative of the fp32 weights after 5 steps (the
    # fused per-slice update vs the foreach one: last-ulp differences), the grad norm
    # within 1e-6, and the bf16 params exactly the masters rounded to bf16.
    master_model, ref_model = _toy(), _toy()
    opt = MasterWeightAdamW(param_groups(master_model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW(
        param_groups(ref_model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True
    )
    assert all(p.dtype == torch.bfloat16 for p in master_model.parameters())
    g = torch.Generator().manual_seed(4)
    for step in range(5):
        for p, q in zip(master_model.parameters(), ref_model.parameters()):
            grad = (torch.randn(p.shape, generator=g) * (3.0 if step == 1 else 0.1)).bfloat16()
            p.grad.copy_(grad)  # a view of the flat bf16 grad buffer
            q.grad = grad.float()
        norm = opt.prepare_grads(0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), 0.5)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        opt.step()
        ref.step()
        opt.zero_grad()
    assert float(opt.step_count) == 5
    masters = torch.cat(
        [opt.state[p]["master"].reshape(-1) for g_ in opt.param_groups for p in g_["params"]]
    )
    want = torch.cat([q.detach().reshape(-1) for g_ in ref.param_groups for q in g_["params"]])
    torch.testing.assert_close(masters, want, rtol=1e-6, atol=1e-8)
    assert torch.equal(opt.flat_param, opt.master.to(torch.bfloat16))


# ---------------------------------------------------------------- the NaN gates

STEPS = 7
BAD = {2: float("nan"), 3: float("inf"), 5: float("inf")}


def _poisoned(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    out = []
    for i, b in enumerate(batches):
        b = dict(b)
        if i in BAD:
            b["y"] = b["y"] + BAD[i]  # a non-finite loss (and non-finite grads)
        out.append(b)
    return out


def _gated_run(lagged: bool):
    model = _toy(dropout=0.1)  # the per-step seeding must give both runs the same masks
    opt = MasterWeightAdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
    sched = RunSchedule([opt], LRScheduleConfig(name="cosine", warmup_steps=5), STEPS)
    guard = NaNGuard(NaNGuardConfig(max_consecutive=5))
    if lagged:
        gate: UpdateGate = LaggedGuard(guard, sched, opt, total_steps=STEPS)
    else:
        gate = UpdateGate(guard, sched)
    fn = GraphableStep(model, opt, precision="bf16", device_type="cpu", grad_clip=0.5)
    rows = []
    for step, batch in enumerate(_poisoned(_batches(STEPS, 4))):
        r = run_step(
            fn,
            opt,
            batch,
            step=step,
            seed=3,
            rank_offset=0,
            device_type="cpu",
            gate=gate,
            host_sync=False,
        )
        gate.end_step()  # as core's trainer calls it
        rows.append((float(r.loss), float(r.grad_norm), float(opt.lr_tensors[0]), r.stepped))
    gate.flush()
    return rows, guard.state_dict(), sched.position, opt.flat_master()


def test_lagged_gate_skips_exactly_like_the_synchronous_gate() -> None:
    sync_rows, sync_guard, sync_pos, sync_w = _gated_run(lagged=False)
    lag_rows, lag_guard, lag_pos, lag_w = _gated_run(lagged=True)
    assert [r[3] for r in sync_rows] == [True, True, False, False, True, False, True]
    assert [r[3] for r in lag_rows] == [None] * STEPS  # decided one step later
    # Losses, grad norms and the lr of every step bit for bit (repr: NaN compares too).
    assert str([r[:3] for r in lag_rows]) == str([r[:3] for r in sync_rows])
    # The lr after a skip stays at the skipped step's: warmup 1..5 over 4 taken updates.
    taken = [0, 1, 2, 2, 2, 3, 3]
    lr = [float(torch.tensor(1e-2 * (k + 1) / 5, dtype=torch.float32)) for k in taken]
    assert [r[2] for r in sync_rows] == lr
    assert lag_guard == sync_guard == {"consecutive": 0, "total_skipped": 3}
    assert lag_pos == sync_pos == 4
    assert torch.equal(lag_w, sync_w) and torch.isfinite(sync_w).all()


def test_eager_step_refuses_a_lagged_gate() -> None:
    model = _toy()
    opt = MasterWeightAdamW(param_groups(model, 0.1), lr=1e-2)
    guard = NaNGuard(NaNGuardConfig())
    gate = LaggedGuard(guard, RunSchedule([opt], LRScheduleConfig(), 3), opt, total_steps=3)
    with pytest.raises(ValueError, match="synchronous UpdateGate"):
        train_step(
            model, opt, _batches(1, 2), step=0, seed=0, rank_offset=0, device_type="cpu", gate=gate
        )


# ---------------------------------------------------------------- the engine's choices


def test_engine_picks_the_sync_free_step_and_its_gate_where_they_apply() -> None:
    acc = get_accelerator("cpu")
    guard = NaNGuard(NaNGuardConfig())
    common = dict(precision="bf16", grad_clip=0.5, skip_nonfinite_loss=True, cuda_graph=False)

    master_model = _toy()
    master = MasterWeightAdamW(param_groups(master_model, 0.1), lr=1e-2)
    sched = RunSchedule([master], LRScheduleConfig(), 3)
    fn = engine.build_step_fn(master_model, master, acc, accum=1, **common)
    assert isinstance(fn, GraphableStep)
    gate = engine.make_gate(
        guard, sched, step_fn=fn, optimizer=master, accum=1, total_steps=3, accelerator=acc
    )
    assert isinstance(gate, LaggedGuard)
    assert engine.describe_step(fn) == "GraphableStep (master weights)"

    # Accumulation: the eager step and the synchronous gate, saying why.
    assert engine.build_step_fn(master_model, master, acc, accum=2, **common) is None
    gate = engine.make_gate(
        guard, sched, step_fn=None, optimizer=master, accum=2, total_steps=3, accelerator=acc
    )
    assert type(gate) is UpdateGate and "gradient accumulation (2 micro-batches" in gate.why_sync

    # fp32 AdamW: no device skip, so the verdict comes first.
    plain_model = _toy()
    plain = build_optimizer(plain_model, OPTIM, SINGLE)
    assert engine.build_step_fn(plain_model, plain, acc, accum=1, **common) is None
    gate = engine.make_gate(
        guard,
        RunSchedule([plain], LRScheduleConfig(), 3),
        step_fn=None,
        optimizer=plain,
        accum=1,
        total_steps=3,
        accelerator=acc,
    )
    assert type(gate) is UpdateGate and "needs the verdict before its update" in gate.why_sync
    assert engine.describe_step(None) == "train_step"


@pytest.mark.parametrize(("mode", "wrapped"), [("full", 3), ("selective", 2), ("none", 0)])
def test_recompute_wraps_blocks_and_keeps_the_gradients(mode: str, wrapped: int) -> None:
    ref, model = _toy(), _toy()
    model, compiled = engine.prepare_model(
        model,
        SINGLE,
        get_accelerator("cpu"),
        torch.device("cpu"),
        precision="fp32",
        recompute=mode,
        compile=False,
        master_weights=False,
    )
    assert compiled == 0
    names = [type(b).__name__ for b in model.blocks]
    assert names.count("CheckpointWrapper") == wrapped
    batch = _batches(1, 6)[0]
    for m in (ref, model):
        m(batch)["loss"].backward()
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


# ---------------------------------------------------------------- data parallel


def _dp_worker(rank: int, world: int, strategy: str) -> tuple[list[float], torch.Tensor]:
    """2 steps of a global batch of 2 micro-batches of 4 rows: this rank's share (world 2:
    one each; world 1: both, accumulated), dropout on (the micro-batch seeding makes the
    masks those of its global index)."""
    model = _toy(dropout=0.2)
    setup = ParallelSetup(strategy=strategy, world_size=world, rank=rank)
    model = parallelize(model, setup, find_unused_parameters=False)
    opt = build_optimizer(model, OPTIM, setup)
    accum = 2 // world
    losses = []
    for step, batch in enumerate(_batches(2, 8)):
        micro = _split(batch, 2)[rank * accum : (rank + 1) * accum]
        r = train_step(
            model,
            opt,
            micro,
            step=step,
            seed=9,
            rank_offset=rank * accum,
            device_type="cpu",
            grad_clip=OPTIM.grad_clip,
        )
        losses.append(r.loss)
    if strategy == "fsdp" and world > 1:
        return losses, torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    return losses, _flat(model)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_process_gloo_run_equals_one_process(strategy: str) -> None:
    ((single_losses, single_w),) = run_multiprocess(_dp_worker, 1, strategy)
    ranks = run_multiprocess(_dp_worker, 2, strategy)
    for losses, weights in ranks:
        # The global mean loss of each step and the weights: equal up to the order the
        # grads are summed in (1e-6 relative).
        assert losses == pytest.approx(single_losses, rel=1e-6)
        torch.testing.assert_close(weights, single_w, rtol=1e-6, atol=1e-7)
    assert not torch.equal(single_w, _flat(_toy(dropout=0.2)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_step_equals_the_eager_step_on_cuda() -> None:
    # build_step_fn with cuda_graph on CUDA: 3 eager warm-up steps, then the capture and 5
    # replays of the whole master-weight step (forward, backward, clip, update), dropout
    # seeded per step outside the graph: the eager step's losses and masters (1e-5).
    from longboat.core.loop.cuda_graph import GraphedStep

    acc = get_accelerator("cuda")
    results = []
    for graphed in (False, True):
        model = _toy(dropout=0.1).cuda()
        opt = MasterWeightAdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
        fn = engine.build_step_fn(
            model,
            opt,
            acc,
            accum=1,
            precision="bf16",
            grad_clip=0.5,
            skip_nonfinite_loss=True,
            cuda_graph=graphed,
        )
        assert isinstance(fn, GraphedStep) == graphed
        losses = []
        for step, batch in enumerate(_batches(8, 16)):
            batch = {k: v.cuda() for k, v in batch.items()}
            r = run_step(
                fn, opt, batch, step=step, seed=3, rank_offset=0, device_type="cuda",
                device_index=torch.device("cuda").index,
            )  # fmt: skip
            losses.append(r.loss)
        if graphed:
            assert fn.captured and fn.replays == 8 - engine.CUDA_GRAPH_WARMUP
        results.append((torch.tensor(losses), opt.flat_master().cpu()))
    (le, we), (lg, wg) = results
    torch.testing.assert_close(lg, le, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wg, we, rtol=1e-5, atol=1e-6)


def test_levers_resolve_null_master_weights_and_cuda_graph_where_they_apply() -> None:
    from types import SimpleNamespace

    from longboat.core.engine.levers import resolve_fast_path

    def resolve(device="cuda", strategy="ddp", accum=1, dp=1, **train):  # type: ignore[no-untyped-def]
        t = dict(precision="bf16", master_weights=None, cuda_graph=None, recompute="none")
        t.update(compile=False, **train)
        return resolve_fast_path(
            SimpleNamespace(**t), strategy=strategy, optim_name="adamw", device_type=device,
            accum=accum, dp_size=dp,
        )  # fmt: skip

    on = resolve()
    assert (on.master_weights, on.cuda_graph, on.graph_auto, on.notices) == (True, True, True, ())
    cpu = resolve("cpu")
    assert (cpu.master_weights, cpu.cuda_graph) == (True, False)
    assert cpu.notices == ("train.cuda_graph: eager steps (the cpu device has no CUDA graphs).",)
    fsdp = resolve(strategy="fsdp")
    assert (fsdp.master_weights, fsdp.cuda_graph) == (False, False)
    assert fsdp.notices == (
        "train.master_weights: off (parallel.strategy=fsdp shards or wraps the params); "
        "fp32 params under bf16 autocast.",
    )
    accum = resolve(accum=2)
    assert accum.cuda_graph is False and "gradient accumulation of 2" in accum.notices[0]
    assert resolve(precision="fp32").notices == ()  # nothing to say for an fp32 run
    assert resolve(cuda_graph=False).cuda_graph is False  # explicit values stay

"""``longboat-llm train``'s NaN guard without a per-step host read (core's
``megatron.engine.lagged_gate``).

Without clipping the loop skips a non-finite step on the device (torch's fused AdamW with
``found_inf``) and runs the guard's host side one step late. On CPU a run with non-finite
steps must give the synchronous guard's numbers bit for bit (the reference is the loop's
synchronous guard with the same fused AdamW): losses, log lines (loss, lr, grad norm, skip
count), the LR of every applied update, the guard's counters, the weights and the optimizer
state; the abort comes one forward/backward later with the same weights; a resume mid-run
continues the uninterrupted run exactly; and no step but the logged ones reads a step value
on the host (a per-step sync coming back fails the test).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from llm_testkit import compose, make_tiny_dataset, tiny_overrides
from torch.optim.optimizer import register_optimizer_step_pre_hook

from longboat.core.distributed import run_multiprocess
from longboat.core.loop.host_reads import HostReads

NAN, INF = float("nan"), float("inf")
# 0-based steps: one in the LR warm-up (2 steps), a NaN and an inf in a row (grads NaN /
# finite: the inf one only the loss check can skip), the last step (resolved at the end).
BAD = {1: "nan", 4: "inf", 5: "nan", 9: "nan"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("lagged")
    data, tok = make_tiny_dataset(root / "data")
    return data, tok, root


def _overrides(tiny: tuple[Path, Path, Path], name: str, *extra: str) -> list[str]:
    """megatron's step (one-pass update and CUDA graph off) unless ``extra`` turns them on."""
    data, tok, root = tiny
    given = {e.split("=")[0] for e in extra}
    levers = [f"{k}=false" for k in ("optim.one_pass_adamw", "train.cuda_graph") if k not in given]
    return [*tiny_overrides(data, tok, root / name), "optim.grad_clip=0.0", *levers, *extra]


class _Probe:
    """Patches the loop (in the worker process): poisons the losses of chosen steps, counts the
    forward/backward calls (``step``: the step the loop is on), keeps the model, optimizer and
    NaN guard, and records the LR and ``found_inf`` of every inner AdamW ``step()`` call
    (``record_updates``: reading ``found_inf`` is a host read). ``sync=True``: the reference,
    the loop's synchronous guard with the same fused AdamW the lagged path switches to."""

    def __init__(
        self,
        bad: dict[int, str],
        *,
        start: int = 0,
        sync: bool = False,
        record_updates: bool = True,
        device_lr: bool = False,
    ) -> None:
        import longboat.core.train.trainer as core_trainer
        from longboat.core.megatron import optimizer as core_optimizer
        from longboat.core.megatron.engine import ddp as optimizer
        from longboat.core.megatron.engine import lagged_gate as lagged_guard
        from longboat.llm.train import megatron_schedule as step

        self.step: int | None = None
        self.calls = 0
        self.updates: list[tuple[float, float]] = []
        self.built: list = []
        self.guards: list = []
        forward_backward, wrap_and_build = step.forward_backward, optimizer.wrap_and_build
        probe = self

        def poisoned(model, *args, **kwargs):
            probe.step = start + probe.calls
            probe.calls += 1
            loss = forward_backward(model, *args, **kwargs)
            kind = bad.get(probe.step)
            if kind == "nan":  # the grads turn NaN too: an update that is not skipped shows
                for chunk in model:
                    for p in chunk.parameters():
                        p.main_grad.fill_(NAN)
                loss = loss * NAN
            elif kind == "inf":  # finite grads: only the loss check can skip this update
                loss = loss + INF
            return loss

        def build(*args, **kwargs):
            out = wrap_and_build(*args, **kwargs)
            probe.built.append(out)
            return out

        class Guard(core_trainer.NaNGuard):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                probe.guards.append(self)

        step.forward_backward = poisoned
        optimizer.wrap_and_build = build
        core_trainer.NaNGuard = Guard
        if sync:
            blocker = lagged_guard.lagged_guard_blocker

            def reference(opt, *args, **kwargs):
                assert blocker(opt, *args, **kwargs) is None  # the lagged path would apply
                for inner in core_optimizer.inner_optimizers(opt):
                    lagged_guard.use_fused_adamw(inner)
                if device_lr:  # the LR in an fp32 tensor, as the CUDA-graph step keeps it
                    from longboat.core.megatron.optimizer import capturable_torch_adamw

                    capturable_torch_adamw(opt, ("cpu",))
                return "the synchronous reference"

            lagged_guard.lagged_guard_blocker = reference
        if record_updates:

            def pre_hook(opt, args, kwargs):
                found_inf = getattr(opt, "found_inf", None)
                assert all(g["fused"] for g in opt.param_groups)
                skip = 0.0 if found_inf is None else float(found_inf)
                self.updates.append((float(opt.param_groups[0]["lr"]), skip))

            register_optimizer_step_pre_hook(pre_hook)

    def weights_and_state(self) -> tuple[list[torch.Tensor], list]:
        from longboat.core.megatron.optimizer import inner_optimizers

        model, opt = self.built[-1]
        weights = [p.detach().clone() for chunk in model for p in chunk.parameters()]
        states = [
            {k: v.clone() for k, v in s.items()}
            for inner in inner_optimizers(opt)
            for s in inner.state_dict()["state"].values()
        ]
        return weights, states


def _log_rows(overrides: list[str]) -> list[dict]:
    cfg = compose(overrides)
    path = Path(cfg.logging.dir) / str(cfg.logging.run_name) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    timing = ("time", "step_time_s", "tokens_per_s")  # wall-clock values differ run to run
    return [{k: v for k, v in row.items() if k not in timing} for row in rows]


def _run_worker(rank: int, world: int, overrides: list[str], bad, opts: dict) -> dict:
    from longboat.core.loop import NonFiniteLossError
    from longboat.llm.train.training import train as run

    probe = _Probe(
        bad,
        start=opts.get("start", 0),
        sync=opts.get("sync", False),
        device_lr=opts.get("device_lr", False),
    )
    error = None
    result = None
    try:
        result = run(compose(overrides, world_size=world))
    except NonFiniteLossError as exc:
        error = str(exc)
    weights, states = probe.weights_and_state()
    return {
        "losses": None if result is None else result.losses,
        "start": None if result is None else result.start_step,
        "rows": None if result is None else _log_rows(overrides),
        "updates": probe.updates,
        "calls": probe.calls,
        "counts": probe.guards[-1].state_dict(),
        "error": error,
        "weights": weights,
        "states": states,
    }


def _same_tensors(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                assert torch.equal(x[k], y[k]), (i, k)
        else:
            assert torch.equal(x, y), i


def _applied_lrs(updates: list[tuple[float, float]]) -> list[float]:
    return [lr for lr, skip in updates if skip == 0.0]


@pytest.mark.multiprocess
def test_lagged_guard_equals_the_synchronous_guard_exactly(tiny) -> None:
    log = "train.log_every=4"
    sync_run, lagged_run = _overrides(tiny, "eq_sync", log), _overrides(tiny, "eq_lagged", log)
    (sync,) = run_multiprocess(_run_worker, 1, sync_run, BAD, {"sync": True})
    (lagged,) = run_multiprocess(_run_worker, 1, lagged_run, BAD, {})
    # The reference stepped the optimizer only for good steps; the lagged run called it every
    # step and skipped the bad ones on the device (found_inf = 1).
    assert len(sync["updates"]) == 6 and all(skip == 0.0 for _, skip in sync["updates"])
    assert [skip for _, skip in lagged["updates"]] == [float(s in BAD) for s in range(10)]
    assert str(lagged["losses"]) == str(sync["losses"])  # str: NaN == NaN
    assert [s for s, v in enumerate(lagged["losses"]) if not math.isfinite(v)] == sorted(BAD)
    assert lagged["rows"] == sync["rows"]  # loss, lr, grad_norm, skipped_steps at 4, 8, 10
    assert [r["skipped_steps"] for r in lagged["rows"] if "loss" in r] == [1, 3, 4]
    # The LR of every applied update, bit for bit; a skipped step repeats its LR.
    assert _applied_lrs(lagged["updates"]) == _applied_lrs(sync["updates"])
    lrs = [lr for lr, _ in lagged["updates"]]
    assert lrs[4] == lrs[5] == lrs[6] and lrs[1] == lrs[2] and lrs[6] != lrs[7]
    assert lagged["counts"] == sync["counts"] == {"consecutive": 1, "total_skipped": 4}
    _same_tensors(lagged["weights"], sync["weights"])
    _same_tensors(lagged["states"], sync["states"])
    assert all(torch.isfinite(w).all() for w in lagged["weights"])


@pytest.mark.multiprocess
def test_one_pass_update_with_clipping_keeps_the_lagged_guard_exactly(tiny) -> None:
    """optim.one_pass_adamw skips (found_inf) and clips (a device grad norm) on the device, so
    with clipping on the loop still takes the lagged guard: same numbers as the synchronous
    guard over the same one-pass update, bit for bit."""
    extra = ("train.log_every=4", "optim.one_pass_adamw=true", "optim.grad_clip=0.5")
    sync_run, lagged_run = _overrides(tiny, "op_sync", *extra), _overrides(tiny, "op_lag", *extra)
    (sync,) = run_multiprocess(_run_worker, 1, sync_run, BAD, {"sync": True})
    (lagged,) = run_multiprocess(_run_worker, 1, lagged_run, BAD, {})
    assert sync["updates"] == lagged["updates"] == []  # torch's AdamW never steps
    assert str(lagged["losses"]) == str(sync["losses"])
    assert lagged["rows"] == sync["rows"]  # incl. the device-clipped steps' grad norms
    norms = [r["grad_norm"] for r in lagged["rows"] if "loss" in r]
    assert all(n is None or (math.isfinite(n) and n > 0) for n in norms), norms
    assert any(n is not None and n > 0.5 for n in norms), norms  # the clipping engaged
    assert lagged["counts"] == sync["counts"] == {"consecutive": 1, "total_skipped": 4}
    _same_tensors(lagged["weights"], sync["weights"])
    _same_tensors(lagged["states"], sync["states"])
    assert all(torch.isfinite(w).all() for w in lagged["weights"])


@pytest.mark.multiprocess
def test_cuda_graph_step_equals_the_synchronous_guard_exactly(tiny) -> None:
    """train.cuda_graph: the step that is captured on a GPU (run eagerly here: the CPU has no
    CUDA graphs) skips on the device and takes its LR from a device table indexed by the
    updates taken. The reference is the synchronous guard with the same fused AdamW reading
    its LR from an fp32 tensor (the table's precision): the same numbers bit for bit (losses,
    log lines, counters, weights, optimizer state, every applied update's LR)."""
    one_micro = ("train.log_every=4", "train.global_batch_size=2")
    sync_run = _overrides(tiny, "g_sync", *one_micro)
    graph_run = _overrides(tiny, "g_graph", *one_micro, "train.cuda_graph=true")
    (sync,) = run_multiprocess(_run_worker, 1, sync_run, BAD, {"sync": True, "device_lr": True})
    (graph,) = run_multiprocess(_run_worker, 1, graph_run, BAD, {})
    assert [skip for _, skip in graph["updates"]] == [float(s in BAD) for s in range(10)]
    assert str(graph["losses"]) == str(sync["losses"])
    assert graph["rows"] == sync["rows"]
    assert _applied_lrs(graph["updates"]) == _applied_lrs(sync["updates"])
    assert graph["counts"] == sync["counts"] == {"consecutive": 1, "total_skipped": 4}
    _same_tensors(graph["weights"], sync["weights"])
    _same_tensors(graph["states"], sync["states"])


@pytest.mark.multiprocess
def test_abort_comes_one_step_later_with_the_same_weights(tiny) -> None:
    bad = {3: "nan", 4: "nan", 5: "nan", 6: "nan"}
    extra = ("train.log_every=10", "train.nan_guard.max_consecutive=2")
    sync_run, lagged_run = _overrides(tiny, "ab_sync", *extra), _overrides(tiny, "ab_lag", *extra)
    (sync,) = run_multiprocess(_run_worker, 1, sync_run, bad, {"sync": True})
    (lagged,) = run_multiprocess(_run_worker, 1, lagged_run, bad, {})
    assert "2 consecutive steps" in sync["error"] and "2 consecutive steps" in lagged["error"]
    assert "at step 5;" in lagged["error"]  # 0-based step 4, resolved during step 5
    assert (sync["calls"], lagged["calls"]) == (5, 6)  # one forward/backward more
    assert len(lagged["updates"]) == 5  # ... and no update for it
    assert lagged["counts"] == sync["counts"] == {"consecutive": 2, "total_skipped": 2}
    _same_tensors(lagged["weights"], sync["weights"])
    _same_tensors(lagged["states"], sync["states"])


@pytest.mark.multiprocess
def test_resume_mid_run_equals_the_uninterrupted_run(tiny) -> None:
    # Step 3 (index 2) is skipped and is a checkpoint's step without a log line (log lines at
    # 2, 4, ...): its verdict is pending when the checkpoint is due, so the save resolves it.
    bad = {2: "nan", 6: "inf"}
    root = tiny[2]
    saves = ["checkpoint.every_steps=3", "checkpoint.keep_last=0", "train.log_every=2"]
    straight = _overrides(tiny, "straight", *saves)
    (ref,) = run_multiprocess(_run_worker, 1, straight, bad, {})
    ckpt = root / "straight" / "ckpt" / "step_00000003"
    assert ckpt.is_dir()
    resumed = _overrides(tiny, "resumed", *saves, f"checkpoint.resume={ckpt}")
    (got,) = run_multiprocess(_run_worker, 1, resumed, bad, {"start": 3})
    assert got["start"] == 3 and got["calls"] == 7
    assert got["counts"] == ref["counts"] == {"consecutive": 0, "total_skipped": 2}
    assert str(got["losses"]) == str(ref["losses"][3:])
    ref_rows = [r for r in ref["rows"] if "loss" in r and r["step"] > 3]
    assert [r for r in got["rows"] if "loss" in r] == ref_rows
    assert _applied_lrs(got["updates"]) == _applied_lrs(ref["updates"])[2:]  # steps 0,1 taken
    _same_tensors(got["weights"], ref["weights"])
    _same_tensors(got["states"], ref["states"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["parallel.data_parallel=2", "parallel.tensor_parallel=2"])
def test_ranks_skip_together_and_follow_one_rank(tiny, hf_dirs, layout: str) -> None:
    """At DP=2 / TP=2 the loss is reduced over the world before the device check, so every
    rank skips the same steps with no collective for the verdict; the curve is the one-rank
    lagged run's within fp32 reduction-order noise (1e-4, as test_train_parity)."""
    init = f"model.init_from={hf_dirs['qwen3']}"  # megatron's random init differs at TP=2
    (one,) = run_multiprocess(_run_worker, 1, _overrides(tiny, "w1", init), BAD, {})
    name = layout.replace("parallel.", "").replace("=", "")
    ranks = run_multiprocess(_run_worker, 2, _overrides(tiny, name, init, layout), BAD, {})
    for got in ranks:
        assert [skip for _, skip in got["updates"]] == [float(s in BAD) for s in range(10)]
        assert got["counts"] == one["counts"] == {"consecutive": 1, "total_skipped": 4}
        assert str(got["losses"]) == str(ranks[0]["losses"])
        for a, b in zip(got["losses"], one["losses"], strict=True):
            assert (math.isnan(a) and math.isnan(b)) or a == b == INF or abs(a - b) <= 1e-4


# ------------------------------------------------------------------ no per-step host read


def _reads_worker(rank: int, world: int, overrides: list[str], sync: bool) -> dict:
    from longboat.llm.train.training import train as run

    probe = _Probe({}, sync=sync, record_updates=False)
    mode = HostReads(tag=lambda: probe.step, skip_files=(__file__,))
    with mode:
        run(compose(overrides, world_size=world))
    per_step: dict[int, list[str]] = {}
    for step, name, where in mode.reads:
        if step is not None:
            per_step.setdefault(step, []).append(f"{name} @ {where}")
    return per_step


@pytest.mark.multiprocess
def test_per_step_path_reads_no_step_value_on_the_host(tiny) -> None:
    log = "train.log_every=5"  # log lines after steps 4 and 9
    (lagged,) = run_multiprocess(_reads_worker, 1, _overrides(tiny, "rd_lag", log), False)
    (sync,) = run_multiprocess(_reads_worker, 1, _overrides(tiny, "rd_sync", log), True)
    # The run's first step is read once (so the progress line has a loss from the start);
    # after it, between log lines, the only host read is the lagged guard's read of the
    # PREVIOUS step's staged loss (step 1 has none left: the first step's was read).
    first = ["tolist @ nan_guard.py _read_staged", "tolist @ trainer.py _read_losses"]
    assert lagged.get(0) == first and not lagged.get(1), (lagged.get(0), lagged.get(1))
    for step in (2, 3, 6, 7, 8):
        assert lagged.get(step) == ["tolist @ nan_guard.py _read_staged"], (step, lagged.get(step))
    # The same detector sees the synchronous guard's read of the step's own loss every step:
    # what the assertions above catch if a per-step sync comes back.
    for step in (1, 2, 3, 6, 7, 8):
        assert any("_is_finite" in r for r in sync.get(step, [])), (step, sync.get(step))


# ------------------------------------------------------------------ where it applies


def _fake_optimizer(inner: torch.optim.Optimizer, clip: float = 0.0, scaler=None):
    part = SimpleNamespace(
        config=SimpleNamespace(clip_grad=clip), grad_scaler=scaler, optimizer=inner
    )
    return SimpleNamespace(chained_optimizers=[part])


def test_lagged_guard_blocker_names_why_the_guard_stays_synchronous() -> None:
    from longboat.core.megatron.engine.lagged_gate import lagged_guard_blocker

    on, off = SimpleNamespace(enabled=True), SimpleNamespace(enabled=False)
    p = torch.nn.Parameter(torch.zeros(3))
    adamw = torch.optim.AdamW([p], lr=1e-3)
    assert lagged_guard_blocker(_fake_optimizer(adamw), on) is None
    cases = {
        "train.nan_guard.enabled=false": lagged_guard_blocker(_fake_optimizer(adamw), off),
        "optim.grad_clip > 0": lagged_guard_blocker(_fake_optimizer(adamw, clip=1.0), on),
        "fp16 loss scaling": lagged_guard_blocker(_fake_optimizer(adamw, scaler=object()), on),
        "optim.one_pass_adamw cannot": lagged_guard_blocker(
            _fake_optimizer(adamw), on, one_pass=SimpleNamespace(handles=lambda: False)
        ),
        "optim.fused=false": lagged_guard_blocker(_fake_optimizer(adamw), on, fused=False),
        "not torch's Adam / AdamW": lagged_guard_blocker(
            _fake_optimizer(torch.optim.SGD([p], lr=1e-3)), on
        ),
    }
    for want, reason in cases.items():
        assert reason is not None and want in reason, (want, reason)
    # The one-pass update skips (and clips) on the device itself: clipping keeps it lagged.
    one_pass = SimpleNamespace(handles=lambda: True)
    assert lagged_guard_blocker(_fake_optimizer(adamw, clip=1.0), on, one_pass=one_pass) is None


def test_fused_adamw_skips_on_found_inf_and_foreach_refuses_it() -> None:
    """What the lagged path relies on, in the installed torch: fused AdamW (CPU here) leaves
    weights, moments and step count untouched when ``found_inf`` is 1 and updates when it is
    0; the foreach implementation refuses ``found_inf`` (so the path switches to fused)."""
    from longboat.core.megatron.engine.lagged_gate import use_fused_adamw as _use_fused

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8))
    opt = torch.optim.AdamW([p], lr=1e-2, foreach=True)
    p.grad = torch.randn(8)
    opt.step()  # a foreach state (step on the CPU), as a checkpoint from the sync path has
    _use_fused(opt)
    opt.found_inf = torch.ones((), dtype=torch.float32)
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    p.grad = torch.full((8,), NAN)
    opt.step()
    assert torch.equal(p.detach(), before[0])
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[1][k]), k
    opt.found_inf.zero_()
    p.grad = torch.randn(8)
    opt.step()
    assert float(opt.state[p]["step"]) == 2.0 and not torch.equal(p.detach(), before[0])
    foreach = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2, foreach=True)
    foreach.param_groups[0]["params"][0].grad = torch.ones(2)
    foreach.found_inf = torch.zeros(())
    with pytest.raises(AssertionError, match="found_inf"):
        foreach.step()

"""The sync-free NaN guard of the master-weight step (``LaggedGuard``, core's
``LaggedUpdateGate`` with a ``DeviceLRTable``): the skip is decided on the device, the host
side runs one step late. On CPU (where ``GraphedStep`` runs eagerly) a run
with non-finite steps must give the synchronous guard's numbers bit for bit: losses, grad
norms, the lr of every step, skip flags and counters, and the weights; the abort comes at
most one step later; a resume mid-run continues the uninterrupted run exactly; and the
per-step path reads no step value on the host (a per-step sync coming back fails the test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from embodied_testkit import cpu_train_step, tiny_groot, tiny_groot_batches
from safetensors.torch import load_file

import longboat.embodied.train.training as training_mod
from longboat.core.config.compose import compose_experiment
from longboat.core.config.schema import LRScheduleConfig, NaNGuardConfig, OptimConfig
from longboat.core.distributed import run_multiprocess
from longboat.core.engine.torch.graphable import GraphableStep, LaggedGuard, run_step
from longboat.core.engine.torch.step import train_step
from longboat.core.loop import NaNGuard, NonFiniteLossError
from longboat.core.loop.host_reads import HostReads
from longboat.core.train import LaggedUpdateGate, RunSchedule, UpdateGate
from longboat.embodied.models.groot_n1_6.model import GrootN16
from longboat.embodied.train.trainer import train

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], grad_clip=0.2)
STEPS = 7
NAN, INF = float("nan"), float("inf")


pytestmark = pytest.mark.usefixtures("one_thread")


def _poison(model, bad: dict[int, str], current_step) -> None:
    """Make the loss of step ``s`` non-finite: ``"nan"`` multiplies it by NaN (the grads turn
    NaN too), ``"inf"`` adds inf (the grads stay finite: only the loss check can skip it)."""
    forward = model.forward

    def poisoned(batch, *args, **kwargs):
        out = dict(forward(batch, *args, **kwargs))
        kind = bad.get(current_step())
        if kind == "nan":
            out["loss"] = out["loss"] * NAN
        elif kind == "inf":
            out["loss"] = out["loss"] + INF
        return out

    model.forward = poisoned


def _setup(bad: dict[int, str], current_step):
    model, optimizer = tiny_groot(OPTIM)
    # A warm-up over the whole run: the lr changes every step, so a schedule off by one shows.
    sched = RunSchedule([optimizer], LRScheduleConfig(name="cosine", warmup_steps=5), STEPS)
    _poison(model, bad, current_step)
    return model, optimizer, sched


def _fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _sync_run(batches, bad, max_consecutive=5):
    """Reference: the eager ``train_step`` with core's synchronous ``UpdateGate``."""
    now = [0]
    model, opt, sched = _setup(bad, lambda: now[0])
    guard = NaNGuard(NaNGuardConfig(max_consecutive=max_consecutive))
    gate = UpdateGate(guard, sched)
    rows, host = [], []
    for i, batch in enumerate(batches):
        now[0] = i
        lr = _fp32(sched.get_last_lr())  # the lr this step's update uses
        r = cpu_train_step(model, opt, batch, i, OPTIM.grad_clip, gate=gate)
        rows.append((r.loss, r.grad_norm, r.stepped, lr))
        host.append((guard.state_dict(), sched.position))
    return rows, host, opt


def _lagged_run(batches, bad, max_consecutive=5, raised_at=None):
    now = [0]
    model, opt, sched = _setup(bad, lambda: now[0])
    guard = NaNGuard(NaNGuardConfig(max_consecutive=max_consecutive))
    lagged = LaggedGuard(guard, sched, opt, total_steps=STEPS)
    fn = GraphableStep(model, opt, precision="bf16", device_type="cpu", grad_clip=OPTIM.grad_clip)
    outs, host = [], []
    for i, batch in enumerate(batches):
        now[0] = i
        if raised_at is not None:
            raised_at[0] = i
        r = run_step(
            fn,
            opt,
            batch,
            step=i,
            seed=3,
            rank_offset=0,
            device_type="cpu",
            host_sync=False,
            gate=lagged,
        )
        lagged.end_step()  # as core's trainer calls it: nothing for a lagged gate
        assert r.stepped is None  # decided later
        outs.append((r.loss, r.grad_norm, float(opt.lr_tensors[0])))
        host.append((guard.state_dict(), sched.position))
    if raised_at is not None:
        raised_at[0] = "flush"
    lagged.flush()
    return outs, host, opt, lagged


def test_lagged_guard_equals_the_synchronous_guard_exactly():
    batches = tiny_groot_batches(STEPS)
    bad = {2: "nan", 3: "inf", 5: "inf"}  # two in a row, one alone; a loss-only skip
    ref, ref_host, ref_opt = _sync_run(batches, bad)
    assert [stepped for *_, stepped, _ in ref] == [True, True, False, False, True, False, True]
    assert all(torch.isfinite(torch.tensor(n)) for i, (_, n, _, _) in enumerate(ref) if i != 2)

    outs, host, opt, lagged = _lagged_run(batches, bad)
    got = [(float(loss), float(norm)) for loss, norm, _ in outs]
    want = [(loss, norm) for loss, norm, _, _ in ref]
    # Bit-identical floats (repr is exact and shows NaN as nan, which == would not match).
    assert str(got) == str(want)
    # The lr each step ran at, the step right after a skip included (steps 3, 4 and 6 run
    # at the lr of the skipped step before them), on the device, bit for bit.
    assert [lr for *_, lr in outs] == [lr for *_, lr in ref]
    taken = [0, 1, 2, 2, 2, 3, 3]  # optimizer steps taken before each step
    assert [lr for *_, lr in ref] == [_fp32(OPTIM.lr * (k + 1) / 5) for k in taken]
    # Host side one step late: after step i it has judged steps 0..i-1.
    assert host[0] == ({"consecutive": 0, "total_skipped": 0}, 0)
    assert host[1:] == ref_host[:-1]
    # After the flush: counters, schedule position and last lr equal.
    assert (
        lagged.deferred.guard.state_dict()
        == ref_host[-1][0]
        == {
            "consecutive": 0,
            "total_skipped": 3,
        }
    )
    assert lagged.schedule.position == ref_host[-1][1] == 4
    assert lagged.schedule.schedulers[0].get_last_lr() == [g["lr"] for g in ref_opt.param_groups]
    assert lagged.last is not None and lagged.last.step == STEPS - 1 and lagged.last.stepped
    # Weights, moments and step count: skipped updates never landed.
    for name in ("master", "exp_avg", "exp_avg_sq", "flat_param", "step_count"):
        assert torch.equal(getattr(opt, name), getattr(ref_opt, name)), name
    assert float(opt.step_count) == 4


def test_loss_only_skip_needs_the_device_loss_check():
    # Without the loss check (the pre-issue-8 step) a non-finite loss with finite grads still
    # updates the weights: the equality above depends on it.
    batches = tiny_groot_batches(STEPS)[:2]
    now = [0]
    model, opt, _ = _setup({1: "inf"}, lambda: now[0])
    fn = GraphableStep(model, opt, precision="bf16", device_type="cpu", skip_nonfinite_loss=False)
    run_step(fn, opt, batches[0], step=0, seed=3, rank_offset=0, device_type="cpu")
    before = opt.master.clone()
    now[0] = 1
    r = run_step(fn, opt, batches[1], step=1, seed=3, rank_offset=0, device_type="cpu")
    assert r.loss == INF and r.grad_norm < INF
    assert not torch.equal(opt.master, before)
    fn.skip_nonfinite_loss = True
    before = opt.master.clone()
    run_step(fn, opt, batches[1], step=1, seed=3, rank_offset=0, device_type="cpu")
    assert torch.equal(opt.master, before) and float(opt.found_inf) == 1.0


def test_abort_comes_at_most_one_step_later():
    batches = tiny_groot_batches(STEPS)
    # max_consecutive=2 reached at step 3: the synchronous guard raises inside step 3, the
    # lagged one while resolving step 3, i.e. inside the call for step 4.
    bad = {2: "nan", 3: "inf"}
    with pytest.raises(NonFiniteLossError) as sync_err:
        _sync_run(batches, bad, max_consecutive=2)
    where = [None]
    with pytest.raises(NonFiniteLossError) as lag_err:
        _lagged_run(batches, bad, max_consecutive=2, raised_at=where)
    assert where[0] == 4
    # The same message, naming the step (1-based) that reached the limit.
    assert str(lag_err.value) == str(sync_err.value).replace("; 2 skipped", " at step 4; 2 skipped")
    assert str(lag_err.value).startswith("2 consecutive steps")
    # Reached on the last step: raised by the final flush.
    with pytest.raises(NonFiniteLossError, match="at step 7;"):
        _lagged_run(batches, {5: "nan", 6: "nan"}, max_consecutive=2, raised_at=where)
    assert where[0] == "flush"


def test_lagged_guard_rejects_a_disabled_guard_and_the_wrong_steps():
    now = [0]
    model, opt, sched = _setup({}, lambda: now[0])
    with pytest.raises(ValueError, match="enabled NaN guard"):
        LaggedGuard(NaNGuard(NaNGuardConfig(enabled=False)), sched, opt, total_steps=STEPS)
    batch = tiny_groot_batches(STEPS)[0]
    common = dict(step=0, seed=3, rank_offset=0, device_type="cpu")
    # The eager step cannot skip on the device: it must not take a gate that always allows.
    lagged = LaggedGuard(NaNGuard(NaNGuardConfig()), sched, opt, total_steps=STEPS)
    with pytest.raises(ValueError, match="synchronous UpdateGate"):
        train_step(model, opt, [batch], precision="bf16", gate=lagged, **common)
    # A lagged gate without the device lr table the graphable step reads.
    fn = GraphableStep(model, opt, precision="bf16", device_type="cpu")
    plain = LaggedUpdateGate(NaNGuard(NaNGuardConfig()), sched)
    with pytest.raises(ValueError, match="must be a LaggedGuard"):
        run_step(fn, opt, batch, gate=plain, **common)
    assert float(opt.step_count) == 0  # refused before any update


# ------------------------------------------------------------------ the trainer


def _overrides(out: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out}",
        "train.steps=8",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",  # one micro-batch a step
        "train.log_every=1",
        "train.precision=bf16",
        "train.master_weights=true",
        "optim.schedule.warmup_steps=4",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.save_on_exit=false",
        "data.synthetic.num_episodes=2",
        "data.synthetic.episode_length=12",
        *extra,
    ]


class _Probe:
    """Patches the embodied run: tracks the step run_step is on, poisons chosen steps' losses
    and keeps the NaN guard and the gate the trainer got. ``sync=True`` swaps the lagged gate
    for core's synchronous ``UpdateGate`` (the same GraphableStep, the guard reading each
    step's values on the host): the reference."""

    def __init__(self, monkeypatch, bad: dict[int, str], sync: bool = False) -> None:
        self.step: int | None = None
        self.calls = 0
        self.guards: list[NaNGuard] = []
        self.gates: list[UpdateGate] = []
        original_run_step, original_build = training_mod.run_step, training_mod.build_model
        original_gate = training_mod.EmbodiedTraining.make_gate

        def run_step_spy(*args, **kwargs):
            self.step = kwargs["step"]
            self.calls += 1
            return original_run_step(*args, **kwargs)

        def build(*args, **kwargs):
            model = original_build(*args, **kwargs)
            _poison(model, bad, lambda: self.step)
            return model

        def make_gate(training, guard, schedule):
            self.guards.append(guard)
            gate = UpdateGate(guard, schedule) if sync else original_gate(training, guard, schedule)
            self.gates.append(gate)
            return gate

        monkeypatch.setattr(training_mod, "run_step", run_step_spy)
        monkeypatch.setattr(training_mod, "build_model", build)
        monkeypatch.setattr(training_mod.EmbodiedTraining, "make_gate", make_gate)


def _metrics(out: Path) -> dict[int, dict]:
    path = out / "logs" / "groot_n1_6_tiny" / "metrics.jsonl"
    rows = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = {k: row[k] for k in ("loss", "grad_norm", "lr", "skipped_steps")}
    return rows


def _skipped(rows: dict[int, dict], before: int = 0) -> list[int]:
    """The steps whose update was skipped: where the logged count of skipped steps grows."""
    out, count = [], before
    for step, row in sorted(rows.items()):
        if row["skipped_steps"] > count:
            out.append(step)
        count = row["skipped_steps"]
    return out


def _train(out: Path, *extra: str):
    cfg = compose_experiment("groot_n1_6_tiny", _overrides(out, *extra), world_size=1)
    return train(cfg)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next((out / "export").glob("*.safetensors"))))


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


BAD = {2: "nan", 3: "inf", 6: "inf"}


def test_trainer_lagged_guard_equals_the_synchronous_guard(tmp_path: Path, monkeypatch) -> None:
    runs = {}
    for name in ("sync", "lagged"):
        with monkeypatch.context() as m:
            probe = _Probe(m, BAD, sync=name == "sync")
            _train(tmp_path / name)
            runs[name] = (_metrics(tmp_path / name), probe.guards[-1].state_dict())
            assert probe.gates[-1].lagged == (name == "lagged")
    assert isinstance(probe.gates[-1], LaggedGuard)  # what the run picks by itself
    (sync_rows, sync_counts), (rows, counts) = runs["sync"], runs["lagged"]
    assert _skipped(rows) == [3, 4, 7]
    assert str(rows) == str(sync_rows)  # losses, grad norms, lr, skip counts: bit for bit
    assert counts == sync_counts == {"consecutive": 0, "total_skipped": 3}
    # The schedule did not advance for skipped steps: the lr after step 3 and 4 repeats.
    assert rows[2]["lr"] == rows[3]["lr"] == rows[4]["lr"] != rows[5]["lr"]
    _same_weights(_weights(tmp_path / "lagged"), _weights(tmp_path / "sync"))


def test_trainer_abort_one_step_later(tmp_path: Path, monkeypatch) -> None:
    calls = {}
    for name in ("sync", "lagged"):
        with monkeypatch.context() as m:
            probe = _Probe(m, {2: "nan", 3: "nan"}, sync=name == "sync")
            with pytest.raises(NonFiniteLossError, match="2 consecutive steps") as err:
                # No log line in between: a log line resolves every pending verdict.
                _train(tmp_path / name, "train.nan_guard.max_consecutive=2", "train.log_every=8")
            calls[name] = probe.calls
    assert calls == {"sync": 4, "lagged": 5}
    assert "at step 4;" in str(err.value)


def test_trainer_resume_mid_run_equals_the_uninterrupted_run(tmp_path: Path, monkeypatch) -> None:
    # Step 3 (index 2) is skipped and is the checkpoint's step: its verdict is still pending
    # when the checkpoint is due, so the save must resolve it first.
    bad = {2: "nan", 4: "inf"}
    straight = tmp_path / "straight"
    with monkeypatch.context() as m:
        _Probe(m, bad)
        # Log lines at 2, 4, 6, 8 (each resolves the guard): none at the checkpoint's step.
        _train(straight, "checkpoint.every_steps=3", "checkpoint.keep_last=0", "train.log_every=2")
    resumed = tmp_path / "resumed"
    ckpt = straight / "checkpoints" / "step_00000003"
    with monkeypatch.context() as m:
        probe = _Probe(m, bad)
        result = _train(
            resumed,
            f"checkpoint.resume={ckpt}",
            f"data.path={straight / 'dataset'}",
            "train.log_every=2",
        )
    assert result.start_step == 3 and result.resumed_from == ckpt
    assert probe.guards[-1].state_dict() == {"consecutive": 0, "total_skipped": 2}
    want = {s: r for s, r in _metrics(straight).items() if s > 3}
    assert str(_metrics(resumed)) == str(want)
    _same_weights(_weights(resumed), _weights(straight))


def _reads_per_step(tmp_path: Path, monkeypatch, sync: bool) -> dict[int, list[str]]:
    # The model value-checks its first 2 batches on an accelerator (always on CPU): as on GPU.
    monkeypatch.setattr(GrootN16, "_check_values", lambda self: self._value_checks_left > 0)
    probe = _Probe(monkeypatch, {}, sync=sync)
    mode = HostReads(tag=lambda: probe.step, skip_files=(__file__,))
    with mode:
        _train(tmp_path, "train.log_every=8", "export.enabled=false")
    per_step: dict[int, list[str]] = {}
    for step, name, where in mode.reads:
        if step is not None:
            per_step.setdefault(step, []).append(f"{name} @ {where}")
    return per_step


def test_per_step_path_reads_no_device_value(tmp_path: Path, monkeypatch) -> None:
    # Steps 2..6 (after the value-check batches, before the log line of step 8): the only
    # host read is the lagged guard's read of the PREVIOUS step's staged values.
    per_step = _reads_per_step(tmp_path / "lagged", monkeypatch, sync=False)
    for step in range(2, 7):
        assert per_step.get(step) == ["tolist @ nan_guard.py _read_staged"], (
            step,
            per_step.get(step),
        )


def test_host_read_detector_fails_on_a_per_step_sync(tmp_path: Path, monkeypatch) -> None:
    # The same detector on the synchronous guard (a host read of the step's own loss and
    # grad norm every step): what the test above must catch if a per-step sync came back.
    per_step = _reads_per_step(tmp_path / "sync", monkeypatch, sync=True)
    for step in range(2, 7):
        assert any("nan_guard.py" in r and "_is_finite" in r for r in per_step.get(step, []))


def _world2_run(rank: int, world: int, out: str) -> dict:
    with pytest.MonkeyPatch.context() as m:
        # Only rank 1's loss is non-finite (its grads stay finite): the averaged loss is inf
        # on every rank, so every rank skips on the device and counts it, with no collective.
        probe = _Probe(m, {2: "inf"} if rank == 1 else {})
        result = _train(
            Path(out), "train.global_batch_size=4", "train.log_every=8", "export.enabled=false"
        )
    return {"losses": result.losses, "counts": probe.guards[-1].state_dict()}


@pytest.mark.multiprocess
def test_world2_ranks_skip_together(tmp_path: Path) -> None:
    results = run_multiprocess(_world2_run, 2, str(tmp_path), timeout=180)
    assert str(results[0]["losses"]) == str(results[1]["losses"])
    assert [i for i, v in enumerate(results[0]["losses"]) if v == INF] == [2]
    assert results[0]["counts"] == results[1]["counts"] == {"consecutive": 0, "total_skipped": 1}

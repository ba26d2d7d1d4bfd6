"""Evaluation on held-out episodes (``data.eval_episodes``, ``train.eval_every``): bad values
fail before the model is built naming the key, held-out episodes never reach a training
batch, evaluations are deterministic (twice on the same weights, after a resume, at DP=2 as
at DP=1), their metrics reach metrics.jsonl, and the held-out loss measures what training
changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from embodied_testkit import read_metrics

from longboat.core.checkpoint import CheckpointError
from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess
from longboat.core.train import run_training
from longboat.embodied.train import training as training_module
from longboat.embodied.train.evaluate import HeldOutEval, eval_sample_indices
from longboat.embodied.train.trainer import train
from longboat.embodied.train.training import build_training

pytestmark = pytest.mark.usefixtures("one_thread")


def _overrides(out: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out}",
        "train.steps=4",
        "train.micro_batch_size=4",
        "train.global_batch_size=null",
        "train.log_every=1",
        "logging.progress=false",
        "logging.trackers=[]",
        "data.synthetic.num_episodes=4",
        "data.synthetic.episode_length=10",
        "data.eval_batches=2",
        "export.enabled=false",
        *extra,
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1.5", "must be a fraction in (0, 1)"),
        ("0.0", "must be a fraction in (0, 1)"),
        ("3", "must be a fraction in (0, 1)"),
        ("[1,-2]", "holds [-2], not episode indices"),
        ("[2,2]", "at least one episode, each once"),
    ],
)
def test_bad_eval_episodes_fail_at_composition_naming_the_key(
    tmp_path: Path, value: str, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        compose_experiment("pi05_tiny", _overrides(tmp_path, f"data.eval_episodes={value}"))
    assert err.value.keys == ["data.eval_episodes"]
    text = str(err.value)
    assert f"data.eval_episodes={value.replace(',', ', ')}" in text and message in text
    assert "Fix:" in text and "data.eval_episodes=0.1" in text
    assert not (tmp_path / "dataset").exists()  # nothing generated or built


def test_eval_every_without_a_held_out_set_and_bad_eval_batches_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        compose_experiment(
            "groot_n1_6_tiny", _overrides(tmp_path, "train.eval_every=2", "data.eval_batches=0")
        )
    assert sorted(err.value.keys) == ["data.eval_batches", "train.eval_every"]
    text = str(err.value)
    assert "data.eval_episodes is null" in text and "data.eval_episodes=0.1" in text
    assert "data.eval_batches=0: must be a positive number of batches" in text


@pytest.mark.parametrize(
    ("value", "message", "fix"),
    [
        ("[1,9]", "names episodes [9] that the dataset does not have", "data.eval_episodes=[3]"),
        ("[0,1,2,3]", "holds out all 4 episodes", "hold out fewer episodes"),
        ("0.9", "holds out all 4 episodes", "hold out fewer episodes"),  # round(3.6) = 4
    ],
)
def test_held_out_sets_the_dataset_cannot_give_fail_before_the_model_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, message: str, fix: str
) -> None:
    def no_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was built before the held-out set was checked")

    monkeypatch.setattr(training_module, "build_policy", no_model)
    cfg = compose_experiment("pi05_tiny", _overrides(tmp_path, f"data.eval_episodes={value}"))
    with pytest.raises(ConfigError) as err:
        build_training(cfg)
    assert err.value.keys == ["data.eval_episodes"]
    text = str(err.value)
    assert message in text and fix in text and "data.eval_episodes=" in text


class _RecordingCollate:
    """The run's collator, recording (embodiment, episode) of every sample it collates."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.seen: list[tuple[int, int]] = []

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        self.seen += [(int(s["embodiment_id"]), int(s["episode_index"])) for s in samples]
        return self.collate(samples)


@pytest.mark.parametrize(
    ("value", "held"),
    [
        ("0.25", [[3], [3]]),  # the last quarter of each sub-dataset's 4 episodes
        ("[0,2]", [[0, 2], [0, 2]]),
    ],
)
def test_held_out_episodes_never_reach_a_training_batch(
    tmp_path: Path, value: str, held: list[list[int]]
) -> None:
    cfg = compose_experiment(
        "groot_n1_6_tiny",
        _overrides(
            tmp_path,
            f"data.eval_episodes={value}",
            "data.synthetic.num_embodiments=2",
            "train.steps=13",  # 13 x 4 samples: more than one epoch of the training frames
        ),
    )
    run = build_training(cfg)
    try:
        assert run.data.held_out == held
        per_sub = cfg.data.synthetic.num_episodes * cfg.data.synthetic.episode_length
        held_frames = sum(len(h) for h in held) * cfg.data.synthetic.episode_length
        assert len(run.data.dataset) == 2 * per_sub - held_frames
        assert len(run.data.eval_dataset) == held_frames
        recorder = _RecordingCollate(run.data.collate)
        run.data.collate = recorder
        for _ in run.batches(0):
            pass
        train_eps = {(e, ep) for e in range(2) for ep in range(4) if ep not in held[e]}
        assert len(recorder.seen) == 13 * 4
        assert set(recorder.seen) == train_eps  # every training episode, no held-out one
        recorder.seen.clear()
        run.held_out_eval.collate = recorder
        run.evaluate()
        assert {(e, ep) for e in range(2) for ep in held[e]} == set(recorder.seen)
        assert len(recorder.seen) == 2 * 4  # data.eval_batches x train.micro_batch_size
    finally:
        run.close()


def test_eval_batches_spread_over_every_held_out_frame() -> None:
    assert eval_sample_indices(20, 2, 4) == [[0, 2, 5, 7], [10, 12, 15, 17]]
    assert eval_sample_indices(5, 4, 4) == [[0, 1, 2, 3], [4]]  # fewer frames than asked


def test_evaluate_is_deterministic_and_leaves_modes_and_rng_as_they_were(tmp_path: Path) -> None:
    cfg = compose_experiment("pi05_tiny", _overrides(tmp_path, "data.eval_episodes=[1]"))
    run = build_training(cfg)
    try:
        modes = [m.training for m in run.model.modules()]
        assert all(modes)  # trains in train mode (dropout on)
        rng = torch.get_rng_state()
        first = run.evaluate()
        assert set(first) == {"eval_loss", "eval_action_mse"}
        assert run.evaluate() == first  # bit-identical on the same weights
        assert [m.training for m in run.model.modules()] == modes
        assert torch.equal(torch.get_rng_state(), rng)
        assert 0.1 < first["eval_loss"] < 10 and 0.1 < first["eval_action_mse"] < 10
        with torch.no_grad():
            for p in run.model.parameters():
                if p.requires_grad:
                    p.mul_(0.5)
        changed = run.evaluate()
        assert changed["eval_loss"] != first["eval_loss"]
        assert changed["eval_action_mse"] != first["eval_action_mse"]
    finally:
        run.close()


@pytest.mark.parametrize("experiment", ["groot_n1_6_tiny", "pi05_tiny"])
def test_eval_metrics_are_logged_at_eval_steps_and_reproduced_after_resume(
    tmp_path: Path, experiment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def cfg(steps: int) -> Any:
        return compose_experiment(
            experiment,
            _overrides(
                tmp_path,
                f"train.steps={steps}",
                "train.eval_every=2",
                "train.log_every=3",
                "data.eval_episodes=0.25",
                "checkpoint.every_steps=4",
            ),
        )

    first = train(cfg(4))
    assert sorted(first.eval) == [0, 2, 4]
    rows = {r["step"]: r for r in read_metrics(tmp_path, cfg(4).logging.run_name)}
    for step in (0, 2, 4):
        assert rows[step]["eval_loss"] == first.eval[step]["eval_loss"]
        assert rows[step]["eval_action_mse"] == first.eval[step]["eval_action_mse"]
    assert "eval_loss" not in rows[3] and "loss" in rows[3]  # a log step, not an eval step
    assert first.eval[4]["eval_loss"] != first.eval[0]["eval_loss"]  # training changed it
    out = capsys.readouterr().out
    assert f"Held-out loss: {first.eval[0]['eval_loss']:.4f} -> " in out
    assert "Held-out action_mse:" in out
    again = train(cfg(6))
    assert again.start_step == 4
    assert again.eval[4] == first.eval[4]  # the same weights, the same numbers
    assert sorted(again.eval) == [4, 6]


def _dp_eval(rank: int, world: int, out: str, strategy: str) -> dict[str, float]:
    cfg = compose_experiment(
        "groot_n1_6_tiny",
        _overrides(
            Path(out),
            f"parallel.strategy={strategy}",
            "data.eval_episodes=[1,3]",
            "data.eval_batches=3",  # 3 batches on 2 ranks: rank 1 runs a zero-weight one
        ),
        world_size=world,
    )
    run = build_training(cfg)
    try:
        return run.evaluate()
    finally:
        run.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_dp2_evaluates_what_one_process_does(tmp_path: Path, strategy: str) -> None:
    one = _dp_eval(0, 1, str(tmp_path), "ddp")
    two = run_multiprocess(_dp_eval, 2, str(tmp_path), strategy, timeout=180)
    assert two[0] == two[1]  # all-reduced: every rank reports the same
    for key, value in one.items():
        assert two[0][key] == pytest.approx(value, rel=1e-6), key


def test_held_out_loss_falls_as_the_policy_fits_the_frames_it_evaluates(tmp_path: Path) -> None:
    # The synthetic episodes are independent random walks, so a few dozen steps cannot
    # generalise to unseen ones; evaluating the training frames themselves shows that the
    # evaluation measures what training does (the same HeldOutEval, on the run's trainer).
    def build(cfg: Any) -> Any:
        run = build_training(cfg)
        ev = run.held_out_eval
        run.held_out_eval = HeldOutEval(
            run.data.dataset,
            run.data.collate,
            max_batches=2,
            micro_batch=8,
            seed=cfg.train.seed,
            precision=cfg.train.precision,
            device=ev.device,
        )
        return run

    cfg = compose_experiment(
        "pi05_tiny",
        _overrides(
            tmp_path,
            "train.steps=30",
            "train.micro_batch_size=8",
            "train.eval_every=30",
            "train.log_every=10",
            "data.synthetic.num_episodes=3",
            "data.synthetic.episode_length=8",
            "data.eval_episodes=[2]",
            "optim.schedule.warmup_steps=3",
            "checkpoint.every_steps=1000",
        ),
    )
    result = run_training(cfg, build)
    start, end = result.eval[0], result.eval[30]
    assert end["eval_loss"] < 0.8 * start["eval_loss"], (start, end)
    assert end["eval_action_mse"] < 0.8 * start["eval_action_mse"], (start, end)


def test_a_checkpoint_of_another_held_out_set_is_refused_naming_the_key(tmp_path: Path) -> None:
    train(
        compose_experiment(
            "pi05_tiny", _overrides(tmp_path, "train.steps=1", "data.eval_episodes=[1]")
        )
    )
    other = compose_experiment(
        "pi05_tiny", _overrides(tmp_path, "train.steps=2", "data.eval_episodes=[2]")
    )  # the same number of training frames, other ones
    with pytest.raises(CheckpointError) as err:
        train(other)
    text = str(err.value)
    assert "held_out=[[1]] (this run: [[2]])" in text and "data.eval_episodes" in text

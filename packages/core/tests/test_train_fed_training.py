"""``FedTraining``: a built run trained by the ``Trainer`` on input it does not make itself,
with everything else (model, optimizer, step, state, export) its own."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from longboat.core.config.compose import compose_experiment
from longboat.core.demo import build_training
from longboat.core.train import Trainer, typed_config
from longboat.core.train.training import FedTraining


def _cfg(out: Path):
    overrides = [f"output_dir={out}", "logging.progress=false", "logging.trackers=[]",
                 "train.steps=6", "checkpoint.save_on_exit=false", "checkpoint.every_steps=0"]  # fmt: skip
    return typed_config(compose_experiment("demo", overrides, stack="core"))


def _fit(cfg, wrap):
    training = build_training(cfg)
    try:
        return training, Trainer(cfg, wrap(training)).fit()
    finally:
        training.close()


def test_fed_with_its_own_input_trains_exactly_as_the_run(tmp_path: Path) -> None:
    waits = []

    def counted(training):
        def feed(start):
            for batch in training.batches(start):
                waits.append(start)
                yield batch

        return FedTraining(training, feed)

    _, plain = _fit(_cfg(tmp_path / "plain"), lambda t: t)
    training, fed = _fit(_cfg(tmp_path / "fed"), counted)
    assert fed.losses == plain.losses and len(fed.losses) == 6
    assert waits == [0] * 6  # the trainer drew every batch through the feed
    wrapped = FedTraining(training, training.batches)
    assert wrapped.items_per_step == training.items_per_step  # read through to the run
    assert wrapped.state()["model"] is training.model


def test_fed_batches_replace_the_runs_input(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    fixed = (torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))

    def repeat(training):
        return FedTraining(training, lambda start: itertools.repeat(fixed))

    _, plain = _fit(_cfg(tmp_path / "plain"), lambda t: t)
    _, fed = _fit(_cfg(tmp_path / "fed"), repeat)
    _, again = _fit(_cfg(tmp_path / "again"), repeat)
    assert fed.losses == again.losses
    assert fed.losses[0] != plain.losses[0]
    assert fed.losses[-1] < fed.losses[0]  # one batch, fitted

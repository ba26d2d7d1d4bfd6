"""Value domains: every out-of-domain value is one problem naming the key and the fix,
found by ``validate`` before any work."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from longboat.core.config.domains import ConfigWarning
from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import ExperimentConfig
from longboat.core.config.validate import collect_problems, validate


def _cfg(**overrides: object):  # type: ignore[no-untyped-def]
    cfg = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(ExperimentConfig())))
    for key, value in overrides.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg


def _keys(cfg) -> dict[str, str]:  # type: ignore[no-untyped-def]
    problems = collect_problems(cfg, 1, stacks={})
    assert len({p.key for p in problems}) == len(problems)  # one problem per key
    return {p.key: p.format() for p in problems}


def test_defaults_have_no_domain_problem() -> None:
    assert _keys(_cfg()) == {}


@pytest.mark.parametrize(
    ("key", "value", "message", "fix"),
    [
        ("optim.lr", -1.0, "must be >= 0", "set optim.lr to 0 or more"),
        ("optim.lr", float("nan"), "must be a finite number", "set optim.lr to a number"),
        ("optim.eps", 0.0, "must be > 0", "set optim.eps to a number above 0"),
        ("optim.grad_clip", float("inf"), "must be a finite number", "set optim.grad_clip"),
        ("optim.schedule.decay_steps", 0, "must be >= 1", "set optim.schedule.decay_steps"),
        ("data.seq_len", 0, "must be >= 1", "set data.seq_len to 1 or more"),
        ("data.eval_fraction", 1.0, "must lie in [0, 1)", "set data.eval_fraction to a number"),
        ("data.num_frames", 0, "must be >= 1", "set data.num_frames to 1 or more"),
        ("llm.eval_batches", -1, "must be >= 0", "set llm.eval_batches to 0 or more"),
        ("data.synthetic.episode_length", 0, "must be >= 1", "set data.synthetic.episode_length"),
        ("train.collective_timeout_s", 0, "must be > 0", "set train.collective_timeout_s"),
        ("train.collective_timeout_s", float("inf"), "must be a finite number", "set train."),
    ],
)
def test_a_value_outside_its_domain_names_the_key_and_the_fix(
    key: str, value: object, message: str, fix: str
) -> None:
    problems = _keys(_cfg(**{key: value}))
    assert list(problems) == [key], problems
    assert message in problems[key] and f"Fix: {fix}" in problems[key]


def test_validate_raises_one_config_error_with_every_bad_value() -> None:
    with pytest.raises(ConfigError) as err:
        validate(_cfg(**{"optim.lr": -1.0, "optim.eps": -1e-8}), 1)
    assert err.value.exit_code == 2
    text = str(err.value)
    assert "optim.lr=-1.0: must be >= 0" in text and "optim.eps=-1e-08: must be > 0" in text


def test_pixels_range_and_a_warmup_longer_than_the_run() -> None:
    problems = _keys(_cfg(**{"data.min_pixels": 4096, "data.max_pixels": 1024}))
    assert list(problems) == ["data.max_pixels"]
    assert "is below data.min_pixels=4096" in problems["data.max_pixels"]
    with pytest.warns(ConfigWarning, match=r"optim.schedule.warmup_steps=50 is longer"):
        assert _keys(_cfg(**{"optim.schedule.warmup_steps": 50, "train.steps": 10})) == {}


def test_a_stack_command_refuses_a_negative_lr_before_training(
    tmp_path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    import uuid

    from fake_stack import write_fake_stack

    from longboat.core.cli import stack_main

    site = tmp_path / "site"
    write_fake_stack(site, "fake", module=f"fake_domains_{uuid.uuid4().hex[:8]}")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    calls: list[object] = []
    code = stack_main("fake", ["train", "tiny", "optim.lr=-1"], train=calls.append)
    assert code == 2 and calls == []  # train (data, model) never started
    err = capsys.readouterr().err
    assert "optim.lr=-1.0: must be >= 0 Fix: set optim.lr to 0 or more" in err
    assert "Traceback" not in err

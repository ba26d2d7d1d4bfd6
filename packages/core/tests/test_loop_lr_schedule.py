"""LR schedules: exact values against closed forms, and state_dict round trips."""

from __future__ import annotations

import math

import pytest
import torch

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import LRScheduleConfig
from longboat.core.loop.lr_schedule import build_lr_scheduler

PEAK = 0.5
TOTAL = 110
W = 10


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=PEAK)


def _lrs(cfg: LRScheduleConfig, steps: int, total: int = TOTAL) -> list[float]:
    opt = _opt()
    sched = build_lr_scheduler(opt, cfg, total)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _cfg(name: str, **kw) -> LRScheduleConfig:
    return LRScheduleConfig(name=name, warmup_steps=W, min_lr_ratio=0.1, **kw)


@pytest.mark.parametrize("name", ["constant", "linear", "cosine", "wsd"])
def test_warmup_is_linear_to_peak(name):
    lrs = _lrs(_cfg(name), W + 1)
    for s in range(W):
        assert lrs[s] == pytest.approx(PEAK * (s + 1) / W, rel=1e-12)
    assert lrs[W] == pytest.approx(PEAK, rel=1e-12)  # first post-warmup step: p = 0


def test_constant_after_warmup():
    lrs = _lrs(_cfg("constant"), TOTAL + 5)
    assert all(lr == pytest.approx(PEAK, rel=1e-12) for lr in lrs[W - 1 :])


def test_linear_closed_form():
    lrs = _lrs(_cfg("linear"), TOTAL + 5)
    d = TOTAL - W
    for s in (10, 35, 60, 109, 114):
        p = min(1.0, (s - W) / d)
        assert lrs[s] == pytest.approx(PEAK * (1 - 0.9 * p), rel=1e-12), s
    assert lrs[60] == pytest.approx(PEAK * 0.55, rel=1e-12)  # halfway: midpoint of 1 and 0.1
    assert lrs[114] == pytest.approx(PEAK * 0.1, rel=1e-12)  # clamped at the floor


def test_cosine_closed_form():
    lrs = _lrs(_cfg("cosine"), TOTAL + 5)
    d = TOTAL - W
    for s in (10, 23, 60, 97, 109, 114):
        p = min(1.0, (s - W) / d)
        expected = PEAK * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        assert lrs[s] == pytest.approx(expected, rel=1e-12), s
    assert lrs[60] == pytest.approx(PEAK * 0.55, rel=1e-12)
    assert lrs[110] == pytest.approx(PEAK * 0.1, rel=1e-12)


def test_cosine_custom_decay_steps():
    lrs = _lrs(_cfg("cosine", decay_steps=20), 40)
    assert lrs[W + 10] == pytest.approx(PEAK * 0.55, rel=1e-12)
    assert lrs[W + 25] == pytest.approx(PEAK * 0.1, rel=1e-12)


def test_wsd_closed_form():
    # D = 100 decay-phase steps, K = 0.2 * 100 = 20 of them in the final linear decay.
    lrs = _lrs(_cfg("wsd", wsd_decay_fraction=0.2), TOTAL + 5)
    for s in (10, 50, 89):
        assert lrs[s] == pytest.approx(PEAK, rel=1e-12), s
    for s in (90, 95, 100, 109):
        q = (s - 90) / 20
        assert lrs[s] == pytest.approx(PEAK * (1 - 0.9 * q), rel=1e-12), s
    assert lrs[100] == pytest.approx(PEAK * 0.55, rel=1e-12)
    assert lrs[110] == pytest.approx(PEAK * 0.1, rel=1e-12)
    assert lrs[114] == pytest.approx(PEAK * 0.1, rel=1e-12)


def test_no_warmup_starts_at_peak():
    lrs = _lrs(LRScheduleConfig(name="cosine", warmup_steps=0, min_lr_ratio=0.0), 3, total=4)
    assert lrs[0] == pytest.approx(PEAK, rel=1e-12)
    assert lrs[2] == pytest.approx(PEAK * 0.5, rel=1e-12)  # p = 2/4


@pytest.mark.parametrize("name", ["linear", "cosine", "wsd"])
def test_state_dict_round_trip(name):
    cfg = _cfg(name, wsd_decay_fraction=0.3)
    ref = _lrs(cfg, 60)

    opt = _opt()
    sched = build_lr_scheduler(opt, cfg, TOTAL)
    for _ in range(37):
        opt.step()
        sched.step()
    state = sched.state_dict()

    opt2 = _opt()
    sched2 = build_lr_scheduler(opt2, cfg, TOTAL)
    sched2.load_state_dict(state)
    assert sched2.last_epoch == 37
    assert sched2.get_last_lr() == sched.get_last_lr()
    resumed = []
    for _ in range(23):
        resumed.append(sched2.get_last_lr()[0])
        opt2.step()
        sched2.step()
    assert resumed == pytest.approx(ref[37:60], rel=0, abs=0)  # exact


def test_invalid_config_names_keys():
    with pytest.raises(ConfigError) as info:
        build_lr_scheduler(
            _opt(),
            LRScheduleConfig(name="cosin", warmup_steps=-1, min_lr_ratio=1.5, wsd_decay_fraction=0),
            10,
        )
    assert set(info.value.keys) == {
        "optim.schedule.name",
        "optim.schedule.warmup_steps",
        "optim.schedule.min_lr_ratio",
        "optim.schedule.wsd_decay_fraction",
    }
    assert "constant, linear, cosine, wsd" in str(info.value)

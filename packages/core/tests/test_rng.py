"""RNGState: capture/restore of python, numpy, torch CPU (and device) RNGs."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from longboat.core.device import CPUAccelerator, get_accelerator
from longboat.core.rng import RNGState, seed_everything


def _draw() -> tuple:
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        np.random.randn(1).tolist(),  # exercises numpy's cached-gaussian state
        torch.rand(4),
        torch.nn.functional.dropout(torch.ones(16), p=0.5, training=True),
    )


def _assert_same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    assert a[1] == b[1]
    assert a[2] == b[2]
    assert torch.equal(a[3], b[3])
    assert torch.equal(a[4], b[4])


def test_capture_restore_replays_every_stream() -> None:
    seed_everything(7)
    _draw()
    snap = RNGState.capture(get_accelerator())
    first = _draw()
    second = _draw()
    snap.restore()
    _assert_same(_draw(), first)
    snap.restore()  # a snapshot can be replayed again
    _assert_same(_draw(), first)
    # sanity: successive draws differ, so the equalities above can fail
    assert first[0] != second[0] and not torch.equal(first[3], second[3])


def test_state_dict_round_trips_through_weights_only_load() -> None:
    seed_everything(11)
    live = RNGState()
    buf = io.BytesIO()
    torch.save(live.state_dict(), buf)  # live object: captures now
    expected = _draw()
    seed_everything(999)  # scramble
    buf.seek(0)
    RNGState().load_state_dict(torch.load(buf, weights_only=True))
    _assert_same(_draw(), expected)


def test_seed_everything_is_deterministic() -> None:
    seed_everything(3)
    a = _draw()
    seed_everything(3)
    _assert_same(_draw(), a)
    seed_everything(4)
    assert _draw()[0] != a[0]


def test_restore_without_snapshot_and_wrong_format_fail_clearly() -> None:
    with pytest.raises(RuntimeError, match="no snapshot"):
        RNGState().restore()
    sd = RNGState.capture().state_dict()
    bad = dict(sd, format=99)
    with pytest.raises(ValueError, match="format 99"):
        RNGState().load_state_dict(bad)


class _FakeDeviceAccelerator(CPUAccelerator):
    """An accelerator whose device RNG is a generator of its own (not the CPU one)."""

    name = "fakedev"
    device_type = "fakedev"

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(5)

    def get_rng_state(self) -> torch.Tensor:
        return self.gen.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


def test_device_rng_is_captured_and_restored_on_the_same_device_type() -> None:
    # On CPU the device stream is the CPU one; a real device has a generator of its own.
    acc = _FakeDeviceAccelerator()
    snap = RNGState.capture(acc)
    first = torch.rand(4, generator=acc.gen)
    assert not torch.equal(torch.rand(4, generator=acc.gen), first)
    snap.restore()
    assert torch.equal(torch.rand(4, generator=acc.gen), first)
    torch.rand(3)  # move the CPU stream away from the snapshot's
    cpu_before = torch.get_rng_state()
    with pytest.raises(ValueError, match="'fakedev' device but this run uses 'cpu'"):
        RNGState(get_accelerator("cpu")).load_state_dict(snap.state_dict())
    assert torch.equal(torch.get_rng_state(), cpu_before)  # refused before touching any RNG

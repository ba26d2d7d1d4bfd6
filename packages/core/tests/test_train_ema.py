"""``EMAWeights`` (``ema.*``): the fp32 average against its formula, the warm start and the
cadence, the checkpoint round trip, the swap for an export; stacks without the capability
refuse ``ema.enabled=true`` and the values are checked."""

from __future__ import annotations

import pytest
import torch

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import EMAConfig
from longboat.core.train.ema import EMAWeights

BASE = ["logging.progress=false"]


def _weights(dtype: torch.dtype) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.nn.Parameter(torch.randn(4, 3, generator=g).to(dtype)),
        "b.bias": torch.nn.Parameter(torch.randn(5, generator=g).to(dtype)),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_average_follows_its_formula_in_fp32(dtype: torch.dtype) -> None:
    params = _weights(dtype)
    ema = EMAWeights(params, EMAConfig(enabled=True, decay=0.75, start_step=2, every=2))
    want = {n: p.detach().double() for n, p in params.items()}
    g = torch.Generator().manual_seed(1)
    for step in range(1, 8):
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=g).to(dtype))
        ema.update(step)
        for n, p in params.items():
            w = p.detach().double()
            if step < 2:
                want[n] = w.clone()
            elif step % 2 == 0:
                want[n] = 0.75 * want[n] + 0.25 * w
        for n in params:
            assert ema.average[n].dtype == torch.float32
            assert torch.allclose(ema.average[n].double(), want[n], atol=1e-6), (step, n)
    assert ema.step == 7


def test_state_dict_round_trip_and_swap_restore_exactly() -> None:
    params = _weights(torch.bfloat16)
    cfg = EMAConfig(enabled=True, decay=0.5)
    ema = EMAWeights(params, cfg)
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)
    ema.update(1)
    state = {k: v.clone() for k, v in ema.state_dict().items()}
    assert set(state) == {"step", "a.weight", "b.bias"}
    other = EMAWeights(_weights(torch.bfloat16), cfg)
    other.load_state_dict(state)
    assert other.step == 1
    for n in params:
        assert torch.equal(other.average[n], ema.average[n])
    trained = {n: p.detach().clone() for n, p in params.items()}
    with ema.swapped():
        for n, p in params.items():
            assert torch.equal(p, ema.average[n].to(p.dtype))
            assert not torch.equal(p, trained[n])
    for n, p in params.items():
        assert torch.equal(p, trained[n])
    with pytest.raises(KeyError, match="lacks"):
        other.load_state_dict({"step": torch.tensor(1)})


def test_stacks_without_ema_refuse_it_and_values_are_checked() -> None:
    from longboat.core.config.compose import compose_experiment

    with pytest.raises(ConfigError) as err:
        compose_experiment("demo", [*BASE, "ema.enabled=true"], stack="core")
    assert err.value.keys == ["ema.enabled"] and "the core stack" in str(err.value)
    with pytest.raises(ConfigError) as err:
        compose_experiment("demo", [*BASE, "ema.export=true"], stack="core")
    assert err.value.keys == ["ema.export"]

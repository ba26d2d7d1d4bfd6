"""Probes of core's ``train.*`` / ``export.*`` keys against a stack, for the stacks' tests.

Every stack's test suite runs the same probes (``key_probes``): each sets one core key to a
value other than its default (plus the keys it needs to mean anything) and composes the
stack's experiment with it. The stack either refuses it, exit 2 naming the key
(``ConfigError``), or composes it and then must act on it, which the stack's test asserts
on a tiny run. ``probe_outcome`` composes one probe; ``renamed_key_outcomes`` composes every
old key name a stack and core declare. ``unprobed_core_keys`` lists core keys no probe
covers (core's own test keeps it empty, so a new core key needs a probe).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longboat.core.config.errors import ConfigError
from longboat.core.config.schema import ExportConfig, TrainConfig

TRAINER_KEYS = (
    "train.steps",
    "train.micro_batch_size",
    "train.global_batch_size",
    "train.seed",
    "train.log_every",
    "train.nan_guard.enabled",
    "train.nan_guard.max_consecutive",
    "train.profiler.start_step",
    "train.profiler.end_step",
    "train.profiler.record_shapes",
    "train.collective_timeout_s",
)
"""Keys core's trainer carries out the same way for every stack (core's tests assert them;
a stack's tiny run asserts ``train.steps`` and ``train.log_every`` again)."""


@dataclass(frozen=True)
class KeyProbe:
    """One core key set to a non-default value."""

    key: str
    """The core key under test."""
    overrides: tuple[str, ...]
    """What the probe sets: the key, and the keys it needs (``train.recompute`` for
    ``train.recompute_layers``)."""

    @property
    def id(self) -> str:
        """``key=value`` of the probed key (the test id and the expectation's name)."""
        return next(o for o in self.overrides if o.startswith(self.key + "="))


def key_probes(tmp: Path | str) -> list[KeyProbe]:
    """Every probe; paths (``export.dir``, ``export.adapter_dir``) go under ``tmp``."""

    def probe(key: str, *overrides: str) -> KeyProbe:
        return KeyProbe(key, overrides)

    tmp = Path(tmp)
    return [
        probe("train.recompute", "train.recompute=full"),
        probe("train.recompute", "train.recompute=selective"),
        probe("train.recompute_layers", "train.recompute=full", "train.recompute_layers=1"),
        probe(
            "train.recompute_components",
            "train.recompute=full",
            "train.recompute_components=[vision]",
        ),
        probe("train.compile", "train.compile=true"),
        probe("train.memory_budget", "train.memory_budget=40"),
        probe("train.cuda_graph", "train.cuda_graph=false"),
        probe("train.cuda_graph", "train.cuda_graph=true"),
        probe("train.precision", "train.precision=fp32"),
        probe("train.precision", "train.precision=bf16"),
        probe("train.precision", "train.precision=fp16"),
        probe("train.precision", "train.precision=fp8"),
        probe("train.fp8.recipe", "train.precision=fp8", "train.fp8.recipe=rowwise"),
        probe(
            "train.fp8.allow_recipe_change",
            "train.precision=fp8",
            "train.fp8.allow_recipe_change=true",
        ),
        probe("train.eval_every", "train.eval_every=1"),
        probe("train.profiler.enabled", "train.profiler.enabled=true"),
        probe("export.enabled", "export.enabled=false"),
        probe("export.dir", f"export.dir={tmp / 'export_dir'}"),
        probe("export.format", "export.format=native"),
        probe("export.adapter_dir", f"export.adapter_dir={tmp / 'adapter_dir'}"),
    ]


def _leaves(schema: type, prefix: str) -> list[str]:
    out = []
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            out += _leaves(type(default), f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def core_keys() -> list[str]:
    """Every leaf key of core's ``TrainConfig`` and ``ExportConfig``."""
    return _leaves(TrainConfig, "train.") + _leaves(ExportConfig, "export.")


def unprobed_core_keys(tmp: Path | str = "/tmp") -> list[str]:
    """Core keys neither a probe nor ``TRAINER_KEYS`` covers."""
    probed = {p.key for p in key_probes(tmp)} | set(TRAINER_KEYS)
    return [k for k in core_keys() if k not in probed]


def probe_outcome(
    experiment: str, stack: str, probe: KeyProbe, base: Sequence[str] = ()
) -> ConfigError | None:
    """Compose ``experiment`` of ``stack`` with ``base`` and the probe: the ``ConfigError``
    it raises, or None when it composes."""
    from longboat.core.config.compose import compose_experiment

    try:
        compose_experiment(experiment, [*base, *probe.overrides], stack=stack, world_size=1)
    except ConfigError as exc:
        return exc
    return None


def check_probes(
    experiment: str,
    stack: str,
    probes: Sequence[KeyProbe],
    refused: set[str],
    base: Sequence[str] = (),
) -> None:
    """Assert that the probes whose ids are in ``refused`` are refused naming their key and
    what the stack offers, and that every other probe composes."""
    ids = {p.id for p in probes}
    unknown = refused - ids
    assert not unknown, f"expectations for probes that do not exist: {sorted(unknown)}"
    for probe in probes:
        err = probe_outcome(experiment, stack, probe, base)
        if probe.id in refused:
            assert err is not None, f"{stack} composed {probe.id}, expected a refusal"
            assert probe.key in err.keys, f"{probe.id}: the error names {err.keys}: {err}"
            assert f"the {stack} stack" in str(err), str(err)
        else:
            assert err is None, f"{stack} refused {probe.id}: {err}"


def renamed_key_outcomes(
    experiment: str, stack: str, renamed: Mapping[str, str], base: Sequence[str] = ()
) -> dict[str, ConfigError | None]:
    """For every old key of ``renamed``: the ``ConfigError`` composing ``experiment`` with
    ``<old>=null`` raises (None where the schema still has the key)."""
    from omegaconf import OmegaConf

    from longboat.core.config.compose import compose_experiment

    plain = compose_experiment(experiment, list(base), stack=stack, validate=False)
    out: dict[str, Any] = {}
    for old in renamed:
        if OmegaConf.select(plain, old, default=KeyError) is not KeyError:
            out[old] = None
            continue
        try:
            compose_experiment(experiment, [*base, f"{old}=null"], stack=stack, world_size=1)
            out[old] = None
        except ConfigError as exc:
            out[old] = exc
    return out


__all__ = [
    "TRAINER_KEYS",
    "KeyProbe",
    "check_probes",
    "core_keys",
    "key_probes",
    "probe_outcome",
    "renamed_key_outcomes",
    "unprobed_core_keys",
]

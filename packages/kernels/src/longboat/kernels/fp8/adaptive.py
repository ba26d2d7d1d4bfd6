"""The ``adaptive`` FP8 recipe: per GEMM shape, FP8 or bf16, by measured speed.

A linear's shape is ``(M, N, K)`` (tokens, outputs, inputs). For each shape the chooser
needs the time of one forward + backward of the linear in bf16 and in each FP8 recipe
(``measure_linear``, on the run's GPU); it picks the fastest, but an FP8 recipe only where
it beats bf16 by ``min_speedup`` (FP8 costs accuracy, so a tie goes to bf16). Timings are
cached in a JSON file per GPU name and shape (``TimingCache``), so a run measures a shape
once per GPU; ``choice_table`` renders the decisions for the log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

Shape = tuple[int, int, int]
HIGH_PRECISION = "bf16"
"""The adaptive chooser's name for "no FP8" (the GEMMs in the run's dtype)."""
CACHE_ENV = "LONGBOAT_FP8_TIMINGS"
"""Environment variable naming the timing cache file."""


def default_cache_path() -> Path:
    """``$LONGBOAT_FP8_TIMINGS``, else ``~/.cache/longboat/fp8_gemm_timings.json``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "longboat" / "fp8_gemm_timings.json"


def shape_key(shape: Shape) -> str:
    """``"MxNxK"``: a shape as a JSON key."""
    return "x".join(str(int(d)) for d in shape)


def choose(timings: Mapping[str, float], min_speedup: float = 1.05) -> str:
    """The choice for one shape from ``{"bf16": ms, "<recipe>": ms, ...}``: the fastest FP8
    recipe if it is at least ``min_speedup`` times faster than bf16, else ``bf16``."""
    if HIGH_PRECISION not in timings:
        raise ValueError(f"timings {dict(timings)} have no {HIGH_PRECISION!r} entry")
    base = timings[HIGH_PRECISION]
    fp8 = {name: ms for name, ms in timings.items() if name != HIGH_PRECISION}
    if not fp8:
        return HIGH_PRECISION
    best = min(fp8, key=lambda name: (fp8[name], name))
    return best if fp8[best] * min_speedup <= base else HIGH_PRECISION


@dataclass
class TimingCache:
    """Per-GPU, per-shape linear timings (ms), kept in a JSON file:
    ``{gpu: {"MxNxK": {"bf16": ms, "blockwise": ms, ...}}}``."""

    path: Path = field(default_factory=default_cache_path)
    data: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | str | None = None) -> TimingCache:
        """The cache at ``path`` (default ``default_cache_path()``); empty if missing or
        unreadable (a corrupt file is measured again, not trusted)."""
        p = Path(path) if path is not None else default_cache_path()
        try:
            data = json.loads(p.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        return cls(p, data)

    def get(self, gpu: str, shape: Shape) -> dict[str, float] | None:
        return self.data.get(gpu, {}).get(shape_key(shape))

    def put(self, gpu: str, shape: Shape, timings: Mapping[str, float]) -> None:
        self.data.setdefault(gpu, {})[shape_key(shape)] = {k: float(v) for k, v in timings.items()}

    def save(self) -> None:
        """Write the file atomically (temporary file + rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        tmp.replace(self.path)


Measure = Callable[[Shape, tuple[str, ...]], dict[str, float]]


@dataclass
class AdaptiveChooser:
    """Per-shape FP8-or-bf16 decisions for one GPU, measuring shapes the cache lacks."""

    gpu: str
    """The GPU's name (the cache key)."""
    recipes: tuple[str, ...] = ("blockwise", "rowwise", "tensorwise")
    """FP8 recipes to consider."""
    cache: TimingCache = field(default_factory=TimingCache)
    measure: Measure | None = None
    """``measure(shape, names) -> {name: ms}`` for bf16 and the recipes; None: cache only
    (a missing shape is an error)."""
    min_speedup: float = 1.05
    decisions: dict[Shape, str] = field(default_factory=dict)

    def choice(self, shape: Shape) -> str:
        """``bf16`` or a recipe name for ``shape``, measured (and cached) on first use."""
        if shape in self.decisions:
            return self.decisions[shape]
        names = (HIGH_PRECISION, *self.recipes)
        timings = self.cache.get(self.gpu, shape)
        if timings is None or any(n not in timings for n in names):
            if self.measure is None:
                raise KeyError(f"no FP8 timings for shape {shape_key(shape)} on {self.gpu}")
            timings = self.measure(shape, names)
            self.cache.put(self.gpu, shape, timings)
            self.cache.save()
        picked = choose({n: timings[n] for n in names}, self.min_speedup)
        self.decisions[shape] = picked
        return picked

    def table(self) -> str:
        """The decisions so far as a text table (``choice_table``)."""
        return choice_table(
            self.decisions, {s: self.cache.get(self.gpu, s) or {} for s in self.decisions}
        )


def choice_table(
    decisions: Mapping[Shape, str], timings: Mapping[Shape, Mapping[str, float]]
) -> str:
    """One line per shape: ``M x N x K``, each option's ms, the choice."""
    names: list[str] = []
    for t in timings.values():
        names += [n for n in t if n not in names]
    head = ["M x N x K", *[f"{n} ms" for n in names], "choice"]
    rows = [head]
    for shape in sorted(decisions):
        t = timings.get(shape, {})
        cells = [f"{t[n]:.3f}" if n in t else "-" for n in names]
        rows.append([" x ".join(map(str, shape)), *cells, decisions[shape]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def measure_linear(
    shape: Shape,
    names: Iterable[str],
    *,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 3,
    iters: int = 10,
) -> dict[str, float]:
    """Median ms of one forward + backward (input and weight gradients) of a linear of
    ``shape`` on ``device`` for each of ``names`` (``bf16`` or an FP8 recipe), timed with the
    accelerator's events."""
    with torch.enable_grad():  # also when first asked from an evaluation's forward
        return _measure(shape, names, device, dtype, warmup, iters)


def _measure(
    shape: Shape, names: Iterable[str], device: torch.device, dtype: torch.dtype,
    warmup: int, iters: int,
) -> dict[str, float]:  # fmt: skip
    from longboat.core.device import get_accelerator
    from longboat.kernels.fp8.linear import fp8_linear, high_precision_linear

    acc = get_accelerator()
    m, n, k = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(dtype).requires_grad_()
    dy = torch.randn(m, n, device=device, generator=gen).to(dtype)
    out: dict[str, float] = {}
    for name in names:

        def step(name: str = name) -> None:
            x.grad = w.grad = None
            if name == HIGH_PRECISION:
                y = high_precision_linear(x, w)
            else:
                y = fp8_linear(x, w, recipe=name)
            y.backward(dy)

        for _ in range(warmup):
            step()
        times = []
        for _ in range(iters):
            start, end = acc.event(enable_timing=True), acc.event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out[name] = sorted(times)[len(times) // 2]
    return out


__all__ = [
    "CACHE_ENV",
    "HIGH_PRECISION",
    "AdaptiveChooser",
    "TimingCache",
    "choice_table",
    "choose",
    "default_cache_path",
    "measure_linear",
    "shape_key",
]

"""The memory plan: the predicted peak of a run and the levers chosen to fit its budget.

``estimate_peak`` adds the persistent state (``states.StateBytes``), what the forward saves
for the backward at the micro-batch (``activations.ActivationProfile``, with the recomputed
blocks keeping only their inputs), the batch and a workspace for the backward: the largest
recomputed block's activations, brought back one block at a time, plus two of the largest
block inputs (the gradient flowing through the residual stream and its sum).

``choose_plan`` walks the levers in a fixed order and takes the first choice that fits the
budget. First the levers that change no numerics: per-block recompute (``none``,
``selective``, ``full``), then the micro-batch split (the same global batch in more
accumulated micro-batches). Only where none of those fits, the storage levers, which change
numerics, in levels: bf16 optimizer moments (``optim.moment_dtype=bf16``), then also bf16
weights without masters (``train.master_weight_storage=bf16_sr``), each only where the
stack offers it; every level is tried with recompute at the whole micro-batch before any
level's split (once numerics change, the step keeps its size, as a reference that trains
all in bf16 does; a split turns the CUDA-graphed step off and adds passes). The plan's
line names a storage key it chose and says that it changes numerics. A lever the user pinned
by its key stays as set; when nothing fits, a ``ConfigError`` gives the numbers before any
work.
``report.MeasuredPeak`` prints the measured peak next to the prediction after the first
steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from longboat.core.config.errors import ConfigError, ConfigProblem
from longboat.core.engine.memory.activations import ActivationProfile
from longboat.core.engine.memory.budget import format_bytes
from longboat.core.engine.memory.states import OptimizerLayout, StateBytes

RECOMPUTE_ORDER = ("none", "selective", "full")
"""``train.recompute`` values from the least to the most recompute."""


def recomputed_blocks(mode: str, num_blocks: int) -> tuple[int, ...]:
    """Indices of the blocks ``mode`` recomputes (the torch engine's rule: ``selective``
    every second block from the first, ``full`` every block)."""
    if mode == "none":
        return ()
    if mode == "selective":
        return tuple(range(0, num_blocks, 2))
    if mode == "full":
        return tuple(range(num_blocks))
    raise ValueError(f"recompute mode {mode!r}: use one of {RECOMPUTE_ORDER}")


@dataclass(frozen=True)
class PlanChoice:
    """One setting of the levers."""

    recompute: str
    """``train.recompute``."""
    micro_batch: int
    """Samples per forward / backward on a rank."""
    moment_bytes: int = 4
    """Bytes of an optimizer moment element (2: bf16 moments)."""
    master_storage: str | None = None
    """``train.master_weight_storage`` where the plan changes it (None: the layout's, which
    holds a pinned storage)."""

    def storage_keys(self, layout: OptimizerLayout) -> tuple[str, ...]:
        """The storage keys this choice sets away from ``layout`` (they change numerics)."""
        keys = []
        if self.moment_bytes != layout.moment_bytes:
            keys.append(f"optim.moment_dtype={'bf16' if self.moment_bytes == 2 else 'fp32'}")
        if self.master_storage not in (None, layout.master_storage):
            keys.append(f"train.master_weight_storage={self.master_storage}")
        return tuple(keys)


def choice_layout(layout: OptimizerLayout, choice: PlanChoice) -> OptimizerLayout:
    """``layout`` with ``choice``'s storage."""
    return dataclasses.replace(
        layout,
        moment_bytes=choice.moment_bytes,
        master_storage=choice.master_storage or layout.master_storage,
    )


@dataclass(frozen=True)
class PeakEstimate:
    """The predicted peak of one choice, by part (bytes)."""

    states: StateBytes
    """The persistent state (``states.state_bytes``)."""
    activations: int
    """What the forward saves for the backward, recomputed blocks keeping their inputs."""
    workspace: int
    """The backward's working set (module doc)."""
    batch: int
    """The micro-batch on the device."""
    allowance: int = 0
    """A fixed allowance for what no shape predicts (the allocator's fragmentation, library
    workspaces), where the estimator adds one."""

    @property
    def total(self) -> int:
        """The predicted peak."""
        return self.states.total + self.activations + self.workspace + self.batch + self.allowance

    def breakdown(self) -> str:
        """``weights a + grads b + ...`` (``format_bytes``)."""
        s = self.states
        parts = [("weights", s.weights + s.frozen), ("grads", s.grads), ("masters", s.masters),
                 ("moments", s.moments), ("other", s.extra), ("activations", self.activations),
                 ("workspace", self.workspace + self.batch + s.scratch),
                 ("allocator allowance", self.allowance)]  # fmt: skip
        return " + ".join(f"{name} {format_bytes(b)}" for name, b in parts if b)


def estimate_peak(
    states: StateBytes, layout: OptimizerLayout, profile: ActivationProfile, choice: PlanChoice
) -> PeakEstimate:
    """The predicted peak of ``choice`` (module doc)."""
    new = choice_layout(layout, choice)
    if new != layout:
        states = states.with_storage(layout, new)
    b = choice.micro_batch
    redo = recomputed_blocks(choice.recompute, profile.num_blocks)
    saved = profile.saved(b, redo)
    inputs = [profile.input_bytes(b, i) for i in range(profile.num_blocks)]
    workspace = max((profile.block_bytes(b, i) for i in redo), default=0)
    workspace += 2 * max(inputs, default=0)
    return PeakEstimate(states, saved, workspace, profile.batch_bytes(b))


@dataclass(frozen=True, kw_only=True)
class Pins:
    """The levers the user set by their keys (the planner leaves them as set)."""

    recompute: str | None = None
    """``train.recompute`` as set (None: the plan chooses)."""
    micro_batch: bool = False
    """The micro-batch stays whole (e.g. ``train.cuda_graph=true`` captures one a step)."""
    moment_bytes: int | None = None
    """The optimizer moments' storage as set (None: the plan may choose where allowed)."""
    master_storage: str | None = None
    """``train.master_weight_storage`` as set (None: the plan may choose where allowed)."""

    def describe(self) -> str:
        """The pinned keys, for messages."""
        keys = []
        if self.recompute is not None:
            keys.append(f"train.recompute={self.recompute}")
        if self.micro_batch:
            keys.append("one micro-batch a step")
        if self.moment_bytes is not None:
            keys.append(f"optim.moment_dtype={'bf16' if self.moment_bytes == 2 else 'fp32'}")
        if self.master_storage is not None:
            keys.append(f"train.master_weight_storage={self.master_storage}")
        return ", ".join(keys) or "nothing pinned"


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of one run: its choice, the predicted peak and the budget it fits."""

    choice: PlanChoice
    estimate: PeakEstimate
    budget: float | None
    """Bytes planned for (None: no budget, nothing was chosen)."""
    budget_source: str
    """Where the budget comes from (or why there is none)."""
    chosen: tuple[str, ...] = field(default=())
    """The keys the plan set (not pinned, not the default)."""
    changes_numerics: tuple[str, ...] = field(default=())
    """The storage keys among ``chosen`` (they change numerics)."""
    options: tuple[tuple[PlanChoice, PeakEstimate], ...] = field(default=(), compare=False)
    """Every choice the chooser weighed, in its order, with its predicted peak."""

    def line(self) -> str:
        """The one line a run prints."""
        c, e = self.choice, self.estimate
        levers = f"train.recompute={c.recompute}, micro-batch {c.micro_batch}"
        if c.moment_bytes == 2:
            levers += ", optim.moment_dtype=bf16"
        if c.master_storage is not None:
            levers += f", train.master_weight_storage={c.master_storage}"
        peak = f"predicted peak {format_bytes(e.total)} ({e.breakdown()})"
        if self.budget is None:
            return f"Memory plan: no budget ({self.budget_source}); {levers}; {peak}."
        what = f"kept {levers}"
        exact = [k for k in self.chosen if k not in self.changes_numerics]
        if exact:
            what = f"chose {', '.join(exact)}"
        if self.changes_numerics:
            storage = f"{', '.join(self.changes_numerics)}: changes numerics (nothing else fits)"
            what = f"{what}; {storage}" if exact else f"chose {storage}"
        return (f"Memory plan: {what}; {peak} of a {format_bytes(self.budget)} budget "
                f"({self.budget_source}).")  # fmt: skip


def candidate_choices(
    micro_batch: int,
    micro_options: Sequence[int],
    pins: Pins,
    layout: OptimizerLayout,
    storage_levels: Sequence[tuple[int, str | None]],
    recompute_modes: Sequence[str],
) -> list[PlanChoice]:
    """The choices in the chooser's order (module doc): at the run's own storage the
    recompute modes at the whole micro-batch, then the smaller micro-batches at the most
    recompute; then every storage level's recompute modes at the whole micro-batch, then
    their splits."""
    modes = [pins.recompute] if pins.recompute is not None else list(recompute_modes)
    smaller = (
        []
        if pins.micro_batch
        else sorted((m for m in micro_options if m < micro_batch), reverse=True)
    )
    (own_moments, own_storage), *changes = storage_levels
    out = [PlanChoice(m, micro_batch, own_moments, own_storage) for m in modes]
    out.extend(PlanChoice(modes[-1], m, own_moments, own_storage) for m in smaller)
    for moments, storage in changes:
        out.extend(PlanChoice(m, micro_batch, moments, storage) for m in modes)
    for moments, storage in changes:
        out.extend(PlanChoice(modes[-1], m, moments, storage) for m in smaller)
    return out


def storage_levels(
    layout: OptimizerLayout, pins: Pins, *, allow_bf16_moments: bool, allow_bf16_sr: bool
) -> list[tuple[int, str | None]]:
    """(moment bytes, master storage) levels, the run's own first, then each storage change
    the run allows and did not pin, cumulatively: bf16 moments, then bf16_sr weights."""
    moments = pins.moment_bytes or layout.moment_bytes
    levels: list[tuple[int, str | None]] = [(moments, None)]  # a pinned storage: the layout's
    if allow_bf16_moments and pins.moment_bytes is None and moments != 2:
        moments = 2
        levels.append((moments, None))
    if allow_bf16_sr and pins.master_storage is None and layout.master_storage != "bf16_sr":
        levels.append((moments, "bf16_sr"))
    return levels


def micro_batch_options(micro_batch: int) -> list[int]:
    """The micro-batches a split may take: the divisors of ``micro_batch`` (each keeps the
    global batch: the accumulation grows by the same factor)."""
    return [d for d in range(1, micro_batch + 1) if micro_batch % d == 0]


def choose_plan(
    states: StateBytes,
    layout: OptimizerLayout,
    profile: ActivationProfile,
    *,
    micro_batch: int,
    budget: float | None,
    budget_source: str,
    pins: Pins = Pins(),
    micro_options: Sequence[int] | None = None,
    allow_bf16_moments: bool = False,
    allow_bf16_sr: bool = False,
    recompute_modes: Sequence[str] = RECOMPUTE_ORDER,
) -> MemoryPlan:
    """The first choice (module doc) whose predicted peak fits ``budget`` bytes; with no
    budget, the pinned or default levers unchanged. ``micro_options``: the micro-batches a
    split may take (default ``micro_batch_options``); ``allow_bf16_moments`` /
    ``allow_bf16_sr``: the stack offers bf16 moments / bf16 weights without masters
    (stochastic rounding) and the run allows a storage change (both change numerics: tried
    only where nothing else fits); ``recompute_modes``: the modes the stack offers, least
    recompute first."""
    default = PlanChoice(
        pins.recompute or "none",
        micro_batch,
        pins.moment_bytes or layout.moment_bytes,
    )
    if budget is None:
        est = estimate_peak(states, layout, profile, default)
        return MemoryPlan(default, est, None, budget_source, options=((default, est),))
    micros = micro_batch_options(micro_batch) if micro_options is None else micro_options
    levels = storage_levels(layout, pins, allow_bf16_moments=allow_bf16_moments,
                            allow_bf16_sr=allow_bf16_sr)  # fmt: skip
    candidates = candidate_choices(micro_batch, micros, pins, layout, levels, recompute_modes)
    options = tuple((c, estimate_peak(states, layout, profile, c)) for c in candidates)
    for choice, est in options:
        if est.total <= budget:
            chosen = chosen_keys(choice, default, pins)
            numerics = tuple(k for k in choice.storage_keys(layout) if k in chosen)
            return MemoryPlan(choice, est, budget, budget_source, chosen, numerics, options)
    best_choice, best = min(options, key=lambda ce: ce[1].total)
    raise ConfigError(
        [
            ConfigProblem(
                key="train.memory_budget",
                message=(
                    f"the run does not fit {format_bytes(budget)} ({budget_source}; "
                    f"{pins.describe()}): the smallest plan, train.recompute="
                    f"{best_choice.recompute} at micro-batch {best_choice.micro_batch}"
                    + "".join(f", {k}" for k in best_choice.storage_keys(layout))
                    + f", needs {format_bytes(best.total)} ({best.breakdown()})"
                ),
                fix=(
                    "raise train.memory_budget"
                    + (", unset the pinned keys" if pins.describe() != "nothing pinned" else "")
                    + ", or shard the state over more ranks (parallel.strategy=zero1 or fsdp)"
                ),
            )
        ]
    )


def chosen_keys(choice: PlanChoice, default: PlanChoice, pins: Pins) -> tuple[str, ...]:
    """The keys ``choice`` sets away from ``default`` and not pinned (a plan's ``chosen``)."""
    keys = []
    if pins.recompute is None and choice.recompute != "none":
        keys.append(f"train.recompute={choice.recompute}")
    if choice.micro_batch != default.micro_batch:
        keys.append(f"micro-batch {default.micro_batch} -> {choice.micro_batch}")
    if choice.moment_bytes != default.moment_bytes:
        keys.append(f"optim.moment_dtype={'bf16' if choice.moment_bytes == 2 else 'fp32'}")
    if choice.master_storage != default.master_storage:
        keys.append(f"train.master_weight_storage={choice.master_storage}")
    return tuple(keys)

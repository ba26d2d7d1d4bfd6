"""Value domains of config keys, checked before any work is done.

A learning rate of -1, a zero epsilon or a warm-up longer than the run would otherwise
surface as a library traceback after the data is prepared and the model built. Each rule
names a dotted key that any stack may have; keys a config does not hold are skipped, so one
table serves every stack. ``check_domains`` adds a ``ConfigProblem`` per value outside its
domain, naming the key and the fix.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from longboat.core.config.errors import ProblemCollector

__all__ = ["DOMAINS", "ConfigWarning", "check_domains"]


class ConfigWarning(UserWarning):
    """A config that runs, but probably not as meant."""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_RULES: dict[str, tuple[Callable[[float], bool], str, str]] = {
    "positive": (lambda v: v > 0, "must be > 0", "a number above 0"),
    "at_least_1": (lambda v: v >= 1, "must be >= 1", "1 or more"),
    "non_negative": (lambda v: v >= 0, "must be >= 0", "0 or more"),
    "fraction": (lambda v: 0 <= v < 1, "must lie in [0, 1)", "a number in [0, 1)"),
}

DOMAINS: dict[str, str] = {
    # optimizer (every stack)
    "optim.lr": "non_negative",  # 0 holds the weights (a run that only evaluates or exports)
    "optim.eps": "positive",
    "optim.schedule.decay_steps": "at_least_1",
    # the loop (every stack)
    "train.collective_timeout_s": "positive",
    # data (the stacks that have these keys)
    "data.seq_len": "at_least_1",
    "data.eval_fraction": "fraction",
    "data.max_tokens": "at_least_1",
    "data.num_frames": "at_least_1",
    "data.min_pixels": "at_least_1",
    "data.max_pixels": "at_least_1",
    "data.num_samples": "at_least_1",
    "data.num_documents": "at_least_1",
    "data.num_train": "at_least_1",
    "data.num_episodes": "at_least_1",
    "data.episode_length": "at_least_1",
    "data.max_chars": "at_least_1",
    "data.synthetic.num_episodes": "at_least_1",
    "data.synthetic.episode_length": "at_least_1",
    "data.synthetic.num_embodiments": "at_least_1",
    "data.vocab_size": "at_least_1",
    # stack run settings (diffusion checks its own)
    "llm.eval_batches": "non_negative",
    "llm.generate_tokens": "non_negative",
    "llm.generate_repetition_penalty": "positive",
    "vlm.eval_batches": "non_negative",
    "vlm.answer_eval_samples": "non_negative",
}
"""Dotted key -> domain (``positive``, ``at_least_1``, ``non_negative``, ``fraction``).
A null value is not checked (null means "not set" for the optional keys here)."""

FINITE = (
    "optim.lr",
    "optim.eps",
    "optim.weight_decay",
    "optim.grad_clip",
    "train.collective_timeout_s",
)
"""Float keys that must not be NaN or infinite."""


def _get(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    except OmegaConfBaseException:
        return None


def check_domains(cfg: DictConfig, p: ProblemCollector) -> None:
    """Add a problem for every value of ``DOMAINS`` / ``FINITE`` outside its domain; warn
    when the warm-up is longer than the run (``optim.schedule.warmup_steps`` >
    ``train.steps``: a short smoke run of an experiment is legitimate, but its LR never
    reaches the peak)."""
    for key in FINITE:
        value = _get(cfg, key)
        if _number(value) and not math.isfinite(value):
            p.add(key, "must be a finite number", value=value, fix=f"set {key} to a number")
    for key, domain in DOMAINS.items():
        value = _get(cfg, key)
        if not _number(value) or not math.isfinite(value):
            continue
        ok, message, wanted = _RULES[domain]
        if not ok(value):
            p.add(key, message, value=value, fix=f"set {key} to {wanted}")
    lo, hi = _get(cfg, "data.min_pixels"), _get(cfg, "data.max_pixels")
    if _number(lo) and _number(hi) and 1 <= hi < lo:
        p.add(
            "data.max_pixels",
            f"is below data.min_pixels={lo}",
            value=hi,
            fix=f"set data.max_pixels>={lo} or lower data.min_pixels",
        )
    warmup, steps = _get(cfg, "optim.schedule.warmup_steps"), _get(cfg, "train.steps")
    if _number(warmup) and _number(steps) and steps >= 1 and warmup > steps:
        warnings.warn(
            f"optim.schedule.warmup_steps={warmup} is longer than the run "
            f"(train.steps={steps}): the LR never reaches its peak. Fix: set "
            f"optim.schedule.warmup_steps<={steps} or raise train.steps",
            ConfigWarning,
            stacklevel=3,
        )

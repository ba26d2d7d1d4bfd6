"""What acts in an evaluation: the ``ActingPolicy`` protocol and its implementations.

The rollout calls ``begin(slot, episode)`` when environment ``slot`` of the vector starts an
episode, then ``act(slots, observations)`` with the policy observations (camera frames,
``observation.state``, ``task``) of the environments that need an action this step; it
returns one action per slot, ``[len(slots), D]`` in the policy's units (the suite maps them
onto the environment's).

- ``TrainedPolicy``: an exported policy (``inference.load_policy``) acting in chunks, one
  queue per environment; the chunks of all environments that need one are predicted in one
  batch, each from noise seeded by its episode, so an episode's actions do not depend on
  which other episodes share its batch.
- ``ReplayPolicy``: replays recorded action sequences (a demonstration per initial state),
  which proves a suite's success signal with a policy known to succeed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class Episode:
    """One episode of an evaluation."""

    task: str
    """The task's name."""
    index: int
    """The episode's number within its task (0, 1, ...)."""
    seed: int
    """The environment's reset seed; also seeds the policy's noise for this episode."""


class ActingPolicy(Protocol):
    """A policy as the rollout drives it (module doc)."""

    def begin(self, slot: int, episode: Episode) -> None:
        """Environment ``slot`` starts ``episode``."""

    def act(self, slots: Sequence[int], observations: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """One action per slot, ``[len(slots), D]`` (float)."""


class TrainedPolicy:
    """An exported policy (``longboat.embodied.inference.Policy``) acting in chunks."""

    def __init__(self, policy: Any, *, n_action_steps: int | None = None) -> None:
        """``n_action_steps``: actions taken from each chunk (None: the policy's own)."""
        self.policy = policy
        spec = policy.processor.spec
        self.horizon = spec.horizon
        self.noise_dim = spec.action_dim
        steps = policy.n_action_steps if n_action_steps is None else int(n_action_steps)
        if not 1 <= steps <= self.horizon:
            raise ValueError(f"n_action_steps={steps} must be in [1, {self.horizon}]")
        self.n_action_steps = steps
        self._queues: dict[int, deque[np.ndarray]] = {}
        self._noise: dict[int, Any] = {}  # torch.Generator per slot

    def begin(self, slot: int, episode: Episode) -> None:
        import torch  # here: environment processes import this module without torch

        self._queues[slot] = deque()
        self._noise[slot] = torch.Generator().manual_seed(episode.seed)

    def act(self, slots: Sequence[int], observations: Sequence[Mapping[str, Any]]) -> np.ndarray:
        need = [i for i, slot in enumerate(slots) if not self._queues[slot]]
        if need:
            import torch

            noise = torch.stack(
                [
                    torch.randn(self.horizon, self.noise_dim, generator=self._noise[slots[i]])
                    for i in need
                ]
            )
            chunks = self.policy.predict_action_chunks([observations[i] for i in need], noise=noise)
            for row, i in enumerate(need):
                chunk = chunks[row, : self.n_action_steps].numpy()
                self._queues[slots[i]].extend(chunk)
        return np.stack([self._queues[slot].popleft() for slot in slots])


class ReplayPolicy:
    """Replays recorded actions: episode ``k`` plays ``demonstrations[k mod len]`` (the
    demonstration of the suite's initial state ``k mod len``), then holds its last action."""

    def __init__(self, demonstrations: Sequence[Sequence[Sequence[float]]]) -> None:
        if not demonstrations or not all(len(d) for d in demonstrations):
            raise ValueError("ReplayPolicy needs at least one non-empty demonstration")
        self.demonstrations = [np.asarray(d, dtype=np.float64) for d in demonstrations]
        self._playing: dict[int, tuple[np.ndarray, int]] = {}

    def begin(self, slot: int, episode: Episode) -> None:
        demo = self.demonstrations[episode.index % len(self.demonstrations)]
        self._playing[slot] = (demo, 0)

    def act(self, slots: Sequence[int], observations: Sequence[Mapping[str, Any]]) -> np.ndarray:
        out = []
        for slot in slots:
            demo, t = self._playing[slot]
            out.append(demo[min(t, len(demo) - 1)])
            self._playing[slot] = (demo, t + 1)
        return np.stack(out)


__all__ = ["ActingPolicy", "Episode", "ReplayPolicy", "TrainedPolicy"]

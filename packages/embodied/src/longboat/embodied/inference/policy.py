"""An exported policy that acts on raw observations: ``load_policy(dir)`` -> ``Policy``.

``Policy.predict_action_chunk(observation)`` returns the next ``horizon`` actions in the
robot's units; ``Policy.select_action(observation)`` returns one action at a time, sampling
a new chunk when the previous one is used up (``n_action_steps`` of each chunk; ``reset()``
between episodes), as LeRobot's policies do. The observation is one frame as a robot or a
LeRobot dataset gives it (``PolicyProcessor``).
"""

from __future__ import annotations

import contextlib
import json
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from longboat.embodied.inference.processor import PolicyProcessor


class Policy:
    """A policy with its processor (module doc)."""

    def __init__(
        self,
        model: nn.Module,
        processor: PolicyProcessor,
        *,
        device: str | torch.device = "cpu",
        n_action_steps: int | None = None,
    ) -> None:
        """``n_action_steps``: actions ``select_action`` takes from each chunk before it
        samples the next (None: the whole chunk)."""
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.processor = processor.bind(getattr(model, "cfg", None))
        horizon = processor.spec.horizon
        self.n_action_steps = horizon if n_action_steps is None else int(n_action_steps)
        if not 1 <= self.n_action_steps <= horizon:
            raise ValueError(f"n_action_steps={n_action_steps} must be in [1, {horizon}]")
        self._queue: deque[torch.Tensor] = deque()

    @property
    def cameras(self) -> list[str]:
        """The camera keys the policy reads, in its order."""
        return list(self.processor.cameras)

    def reset(self) -> None:
        """Forget the queued actions (call at the start of an episode)."""
        self._queue.clear()

    def _autocast(self) -> Any:
        if self.processor.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def predict_action_chunk(
        self,
        observation: Mapping[str, Any],
        *,
        embodiment: int | None = None,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        num_steps: int | None = None,
    ) -> torch.Tensor:
        """The next ``[horizon, D]`` actions for one raw observation, in the robot's units
        (float32 on the CPU). ``embodiment``: the embodiment id when the observation carries
        none (default 0); ``noise`` ([horizon, action_dim] of the policy, or with a leading
        1), ``generator``, ``num_steps``: the sampler's, as ``predict_action`` takes them."""
        emb = self.processor.embodiment_of(observation, embodiment)
        batch = self.processor.preprocess(observation, embodiment=emb)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if noise is not None:
            noise = noise.to(self.device, torch.float32)
            noise = noise[None] if noise.ndim == 2 else noise
        given = {"noise": noise, "generator": generator, "num_steps": num_steps}
        options = {k: v for k, v in given.items() if v is not None}  # a policy may take none
        with self._autocast():
            actions = self.model.predict_action(batch, **options)
        return self.processor.postprocess(actions, embodiment=emb)[0]

    @torch.no_grad()
    def predict_action_chunks(
        self,
        observations: Sequence[Mapping[str, Any]],
        *,
        embodiment: int | None = None,
        noise: torch.Tensor | None = None,
        num_steps: int | None = None,
    ) -> torch.Tensor:
        """``predict_action_chunk`` for a batch of raw observations of one embodiment (one
        per environment of a vector): ``[B, horizon, D]`` in the robot's units. ``noise``:
        ``[B, horizon, action_dim]`` of the policy (each row seeded by its caller makes a
        row's actions independent of the RNG state)."""
        if not observations:
            raise ValueError("predict_action_chunks needs at least one observation")
        emb = self.processor.embodiment_of(observations[0], embodiment)
        batch = self.processor.preprocess_batch(observations, embodiment=emb)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        given = {"noise": noise, "num_steps": num_steps}
        if noise is not None:
            given["noise"] = noise.to(self.device, torch.float32)
        options = {k: v for k, v in given.items() if v is not None}
        with self._autocast():
            actions = self.model.predict_action(batch, **options)
        return self.processor.postprocess(actions, embodiment=emb)

    def select_action(
        self, observation: Mapping[str, Any], *, embodiment: int | None = None
    ) -> torch.Tensor:
        """One ``[D]`` action in the robot's units: the next of the queued chunk, a new chunk
        for ``observation`` when the queue is empty."""
        if not self._queue:
            chunk = self.predict_action_chunk(observation, embodiment=embodiment)
            self._queue.extend(chunk[: self.n_action_steps])
        return self._queue.popleft()


def load_policy(
    path: str | Path, *, device: str | torch.device = "cpu", n_action_steps: int | None = None
) -> Policy:
    """The policy of an export directory with its processor: a run's ``<output_dir>/export``
    (native) or its reference-format folder (``export/lerobot``, ``export/isaac``)."""
    from longboat.embodied.train.export import CONFIG_NAME, EXPORT_FORMAT, load_exported_policy

    root = Path(path)
    processor = PolicyProcessor.load(root)
    config = root / CONFIG_NAME
    native = config.is_file() and json.loads(config.read_text()).get("format") == EXPORT_FORMAT
    if native:
        model = load_exported_policy(root, device="cpu")
    else:
        model = _load_reference(root, processor)
    return Policy(model, processor, device=device, n_action_steps=n_action_steps)


def _load_reference(root: Path, processor: PolicyProcessor) -> nn.Module:
    """A reference-format folder's policy, read as ``model.init_from`` reads it (its
    architecture + the run's overrides)."""
    from longboat.embodied.models import build_model
    from longboat.embodied.models.init_from import load_initial_weights, resolve_model_config

    name = processor.model_name
    cfg = resolve_model_config(name, "tiny", processor.model_overrides, str(root))
    model = build_model(name, cfg)
    load_initial_weights(model, name, str(root))
    return model

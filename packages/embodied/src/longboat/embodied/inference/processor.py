"""What a policy needs beside its weights to act on raw observations: ``PolicyProcessor``.

An export holds it as ``processor.json`` (and the prompt tokenizer, if the run had one, in
``tokenizer/``, named by that relative path so the folder can be moved). It turns one raw
observation, as a robot or a LeRobot dataset gives it, into the batch the policy's
``predict_action`` takes, exactly as the training run's collator built its batches:

- camera frames (``observation.images.<name>``, the run's cameras): uint8 ``[H, W, C]`` or
  ``[C, H, W]`` (numpy arrays or tensors), or float in [0, 1] (a LeRobot dataset's frames;
  turned back into the uint8 frames training decoded);
- the state (``observation.state``, ``[D]`` in the robot's units), normalised with the
  statistics the run normalised with (one set per embodiment);
- the task text (``task``), tokenised as in training (the run's tokenizer, or the
  byte-level stand-in);

and the policy's actions back into the robot's units (``postprocess``: cut to the dataset's
action width, unnormalised with the same statistics).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from longboat.embodied.data.normalize import Normalizer
from longboat.embodied.models.family import PolicyBatchSpec
from longboat.embodied.models.registry import policy
from longboat.embodied.train.policy_batch import ACTION_KEY, STATE_KEY, PolicyCollator

PROCESSOR_NAME = "processor.json"
"""The processor file of an export (native and reference formats alike)."""
PROCESSOR_FORMAT = "longboat-embodied-processor/1"
TOKENIZER_DIR = "tokenizer"
"""Sub-folder of an export holding the run's prompt tokenizer."""
TASK_KEY = "task"
EMBODIMENT_KEY = "embodiment_id"
NORMALIZATION = {STATE_KEY: "min_max", ACTION_KEY: "min_max"}
"""How the training run normalises state and action (``train/datasets.py``)."""


@dataclass(frozen=True)
class Embodiment:
    """One embodiment (sub-dataset) of the run: its widths and normaliser."""

    state_dim: int
    """Width of ``observation.state`` in the dataset."""
    action_dim: int
    """Width of ``action`` in the dataset (the actions returned have this many values)."""
    normalizer: Normalizer
    """Maps state to and actions from the [-1, 1] range the policy was trained in."""


def _width(stats: Mapping[str, Any], key: str) -> int:
    return int(np.asarray(stats[key]["min"]).reshape(-1).shape[0])


class PolicyProcessor:
    """Raw observation -> policy batch, policy actions -> robot units (module doc)."""

    def __init__(
        self,
        *,
        model_name: str,
        spec: PolicyBatchSpec,
        cameras: Sequence[str],
        embodiments: Sequence[Embodiment],
        tokenizer: Path | None = None,
        precision: str = "fp32",
        fixed_text_length: bool = False,
        model_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        """``tokenizer``: the prompt tokenizer directory (the policy's ``PromptProcessor``
        builds it once the model config is known, ``bind``); None: the byte-level stand-in.
        ``model_overrides``: the run's family config overrides (what a reference-format
        folder's architecture is read with)."""
        self.model_name = model_name
        self.spec = spec
        self.cameras = list(cameras)
        self.embodiments = list(embodiments)
        self.tokenizer = tokenizer
        self.precision = precision
        self.fixed_text_length = fixed_text_length
        self.model_overrides = dict(model_overrides or {})
        self.collate = PolicyCollator(spec, self.cameras, fixed_text_length=fixed_text_length)

    # --- building, saving, loading ------------------------------------------------------------

    @classmethod
    def from_run(
        cls,
        model_name: str,
        collate: PolicyCollator,
        norm_stats: Sequence[Mapping[str, Any]],
        *,
        tokenizer: Path | None,
        precision: str,
        model_overrides: Mapping[str, Any] | None = None,
    ) -> PolicyProcessor:
        """The processor of a training run: its collator (spec, cameras), the statistics
        each sub-dataset was normalised with, its tokenizer directory."""
        embodiments = [
            Embodiment(
                state_dim=_width(stats, STATE_KEY),
                action_dim=_width(stats, ACTION_KEY),
                normalizer=Normalizer(stats, NORMALIZATION),
            )
            for stats in norm_stats
        ]
        return cls(
            model_name=model_name,
            spec=collate.spec,
            cameras=collate.camera_keys,
            embodiments=embodiments,
            tokenizer=tokenizer,
            precision=precision,
            fixed_text_length=collate.fixed_text_length,
            model_overrides=model_overrides,
        )

    def save(self, directory: str | Path) -> Path:
        """Write ``processor.json`` into ``directory`` and copy the tokenizer into its
        ``tokenizer/`` (named there by that relative path); returns the file."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer = None
        if self.tokenizer is not None:
            target = out / TOKENIZER_DIR
            if target.resolve() != Path(self.tokenizer).resolve():
                copy_tokenizer(self.model_name, self.tokenizer, target)
            tokenizer = TOKENIZER_DIR
        body = {
            "format": PROCESSOR_FORMAT,
            "model_name": self.model_name,
            "spec": dataclasses.asdict(self.spec),
            "cameras": self.cameras,
            "tokenizer": tokenizer,
            "precision": self.precision,
            "fixed_text_length": self.fixed_text_length,
            "model_overrides": self.model_overrides,
            "embodiments": [
                {
                    "state_dim": e.state_dim,
                    "action_dim": e.action_dim,
                    "normalizer": e.normalizer.to_dict(),
                }
                for e in self.embodiments
            ],
        }
        path = out / PROCESSOR_NAME
        path.write_text(json.dumps(body, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> PolicyProcessor:
        """Read ``directory/processor.json`` (its tokenizer path relative to ``directory``)."""
        root = Path(directory)
        path = root / PROCESSOR_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist: {root} is not a longboat-embodied export with a "
                "processor (exports of this version write one; re-export older runs)"
            )
        body = json.loads(path.read_text())
        if body.get("format") != PROCESSOR_FORMAT:
            raise ValueError(
                f"{path}: format {body.get('format')!r}, expected {PROCESSOR_FORMAT!r}"
            )
        spec = dict(body["spec"])
        spec["image_size"] = tuple(spec["image_size"])
        embodiments = [
            Embodiment(
                state_dim=int(e["state_dim"]),
                action_dim=int(e["action_dim"]),
                normalizer=Normalizer.from_dict(e["normalizer"]),
            )
            for e in body["embodiments"]
        ]
        return cls(
            model_name=body["model_name"],
            spec=PolicyBatchSpec(**spec),
            cameras=body["cameras"],
            embodiments=embodiments,
            tokenizer=root / body["tokenizer"] if body.get("tokenizer") else None,
            precision=body.get("precision", "fp32"),
            fixed_text_length=bool(body.get("fixed_text_length", False)),
            model_overrides=body.get("model_overrides") or {},
        )

    def bind(self, model_cfg: Any) -> PolicyProcessor:
        """Build the prompt tokenizer for the policy of ``model_cfg`` (the policy's
        ``PromptProcessor.build``, as the run did); returns self."""
        if self.tokenizer is not None:
            prompts = policy(self.model_name).prompts
            assert prompts is not None, f"{self.model_name} reads no tokenizer's prompts"
            self.collate.prompts = prompts.build(Path(self.tokenizer), model_cfg)
        return self

    # --- observations in, actions out ---------------------------------------------------------

    def embodiment(self, index: int) -> Embodiment:
        """The embodiment ``index`` (an observation's ``embodiment_id``)."""
        if not 0 <= index < len(self.embodiments):
            raise ValueError(
                f"embodiment_id={index}: the policy was trained on {len(self.embodiments)} "
                f"embodiment(s), ids 0..{len(self.embodiments) - 1}"
            )
        return self.embodiments[index]

    def embodiment_of(self, observation: Mapping[str, Any], default: int | None = None) -> int:
        """The embodiment id of an observation (its ``embodiment_id``, else ``default``,
        else 0): the position of its sub-dataset in the run (sub-folders in name order), as
        the run numbers sub-datasets without an ``embodiment_id`` column and as the synthetic
        datasets number theirs."""
        given = observation.get(EMBODIMENT_KEY)
        if given is not None:
            return int(torch.as_tensor(given).reshape(-1)[0])
        return 0 if default is None else int(default)

    def preprocess(
        self, observation: Mapping[str, Any], *, embodiment: int | None = None
    ) -> dict[str, torch.Tensor]:
        """One raw observation -> a policy batch of one (CPU tensors)."""
        return self.collate([self._sample(observation, embodiment)])

    def preprocess_batch(
        self, observations: Sequence[Mapping[str, Any]], *, embodiment: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Raw observations (one per environment) -> one policy batch (CPU tensors), each
        row as ``preprocess`` builds it."""
        return self.collate([self._sample(obs, embodiment) for obs in observations])

    def _sample(self, observation: Mapping[str, Any], embodiment: int | None) -> dict[str, Any]:
        """One raw observation -> one collator sample."""
        missing = [k for k in (*self.cameras, STATE_KEY) if k not in observation]
        if missing:
            raise KeyError(
                f"the observation lacks {missing}; the policy reads the cameras "
                f"{self.cameras}, {STATE_KEY!r} (the robot's state, [D]) and {TASK_KEY!r} "
                f"(the task text); it has {sorted(observation)}"
            )
        emb_id = self.embodiment_of(observation, embodiment)
        emb = self.embodiment(emb_id)
        state = torch.as_tensor(np.asarray(observation[STATE_KEY]), dtype=torch.float32)
        state = state.reshape(-1)
        if state.shape[0] != emb.state_dim:
            raise ValueError(
                f"{STATE_KEY} has {state.shape[0]} values; embodiment {emb_id} of the policy "
                f"has a state of {emb.state_dim}"
            )
        sample: dict[str, Any] = {
            STATE_KEY: emb.normalizer.normalize(STATE_KEY, state),
            # No target: every action step is padding (the collator's shapes need one).
            ACTION_KEY: torch.zeros(self.spec.horizon, emb.action_dim),
            f"{ACTION_KEY}_is_pad": torch.ones(self.spec.horizon, dtype=torch.bool),
            TASK_KEY: str(observation.get(TASK_KEY, "")),
            EMBODIMENT_KEY: torch.tensor(emb_id, dtype=torch.int64),
        }
        for key in self.cameras:
            sample[key] = camera_frame(observation[key], key)
        return sample

    def postprocess(self, actions: torch.Tensor, *, embodiment: int = 0) -> torch.Tensor:
        """Policy actions ``[..., horizon, action_dim (padded)]`` -> the robot's units
        ``[..., horizon, D]`` (float32), D the embodiment's action width."""
        emb = self.embodiment(embodiment)
        cut = actions[..., : emb.action_dim].detach().float().cpu()
        return emb.normalizer.unnormalize(ACTION_KEY, cut).float()


def camera_frame(frame: Any, key: str = "camera") -> torch.Tensor:
    """One camera frame as the training run decoded it: uint8 ``[3, H, W]``, from uint8
    ``[H, W, 3]`` / ``[3, H, W]`` or float ``[3, H, W]`` / ``[H, W, 3]`` in [0, 1]."""
    x = frame if isinstance(frame, torch.Tensor) else torch.as_tensor(np.asarray(frame))
    if x.ndim == 4 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 3 or (x.shape[0] != 3 and x.shape[-1] != 3):
        raise ValueError(
            f"camera {key!r}: a frame of shape {tuple(x.shape)}; give one RGB frame, "
            "[H, W, 3] or [3, H, W]"
        )
    if x.shape[0] != 3:
        x = x.permute(2, 0, 1)
    if x.dtype == torch.uint8:
        return x.contiguous()
    if not x.is_floating_point():
        raise ValueError(f"camera {key!r}: frames are uint8 or float in [0, 1], got {x.dtype}")
    return (x.float() * 255.0).round().clamp(0, 255).to(torch.uint8).contiguous()


def copy_tokenizer(model_name: str, source: str | Path, target: str | Path) -> Path:
    """Copy a prompt tokenizer into ``target`` (the policy's own copy where it has one)."""
    prompts = policy(model_name).prompts
    if prompts is not None and prompts.copy is not None:
        return prompts.copy(source, target)
    import shutil

    shutil.copytree(source, target, dirs_exist_ok=True)
    return Path(target)

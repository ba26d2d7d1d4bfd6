"""``longboat demo``: the smallest real thing longboat-core does end to end.

An MLP learns a synthetic regression target (a fixed random "teacher" network
plus noise) on CPU in seconds, using every shared core part: the composed and
validated config, the LR schedule, the stateful sampler, metrics JSONL +
TensorBoard, the rich progress bar, the NaN guard, the profiler window,
periodic and SIGTERM checkpoints, and exact resume. Running it again resumes
from the last checkpoint.

Torch is imported inside ``run`` so that importing this module (for its config
schemas) stays cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longboat.core.config.schema import DataConfig, ModelConfig
from longboat.core.train.training import Training

if TYPE_CHECKING:
    import torch
    from torch import nn

    from longboat.core.train import RunResult, StepOutput, UpdateGate

__all__ = ["MLPConfig", "SyntheticRegressionConfig", "build_mlp", "build_training", "run"]


@dataclass
class MLPConfig(ModelConfig):
    """A small multilayer perceptron."""

    name: str = "mlp"
    in_features: int = 16
    """Input width (must equal data.in_features)."""
    hidden_size: int = 128
    """Width of every hidden layer."""
    num_layers: int = 3
    """Linear layers in total (>= 1); hidden ones use GELU + dropout."""
    out_features: int = 1
    """Output width (must equal data.out_features)."""
    dropout: float = 0.1
    """Dropout after each hidden activation."""


@dataclass
class SyntheticRegressionConfig(DataConfig):
    """Inputs ~ N(0, 1); targets from a fixed random tanh teacher network plus Gaussian noise."""

    name: str = "synthetic_regression"
    num_train: int = 4096
    """Training samples."""
    num_eval: int = 512
    """Held-out samples for the eval loss."""
    in_features: int = 16
    """Input width."""
    out_features: int = 1
    """Target width."""
    teacher_hidden: int = 32
    """Hidden width of the teacher that defines the target."""
    noise_std: float = 0.05
    """Std of the noise added to the targets (the floor of the achievable MSE is its square)."""


def _check(model: MLPConfig, data: SyntheticRegressionConfig) -> None:
    from longboat.core.config.errors import ConfigError

    for key in ("in_features", "out_features"):
        if getattr(model, key) != getattr(data, key):
            raise ConfigError(
                f"model.{key} does not match data.{key}={getattr(data, key)}",
                key=f"model.{key}",
                value=getattr(model, key),
                fix=f"set model.{key}={getattr(data, key)} (or change data.{key})",
            )
    if model.num_layers < 1:
        raise ConfigError(
            "an MLP needs at least one layer", key="model.num_layers", value=model.num_layers
        )
    if not 0.0 <= model.dropout < 1.0:
        raise ConfigError("must be in [0, 1)", key="model.dropout", value=model.dropout)
    for key in ("num_train", "num_eval"):
        if getattr(data, key) < 1:
            raise ConfigError("must be >= 1", key=f"data.{key}", value=getattr(data, key))


def build_mlp(cfg: MLPConfig) -> nn.Module:
    """Linear -> GELU -> Dropout blocks, then a linear head."""
    from torch import nn

    layers: list[nn.Module] = []
    width = cfg.in_features
    for _ in range(cfg.num_layers - 1):
        layers += [nn.Linear(width, cfg.hidden_size), nn.GELU(), nn.Dropout(cfg.dropout)]
        width = cfg.hidden_size
    layers.append(nn.Linear(width, cfg.out_features))
    return nn.Sequential(*layers)


def synthetic_regression(
    cfg: SyntheticRegressionConfig,
) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """Train and eval sets drawn from ``cfg.seed`` alone (not the global RNG)."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(cfg.seed)
    w1 = torch.randn(cfg.in_features, cfg.teacher_hidden, generator=g) / math.sqrt(cfg.in_features)
    w2 = torch.randn(cfg.teacher_hidden, cfg.out_features, generator=g) / math.sqrt(
        cfg.teacher_hidden
    )

    def make(n: int) -> TensorDataset:
        x = torch.randn(n, cfg.in_features, generator=g)
        y = torch.tanh(x @ w1) @ w2
        return TensorDataset(x, y + cfg.noise_std * torch.randn(y.shape, generator=g))

    return make(cfg.num_train), make(cfg.num_eval)


def _optimizer(cfg: Any, params: Any) -> torch.optim.Optimizer:
    import torch

    from longboat.core.config.errors import ConfigError

    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ConfigError("unknown optimizer", key="optim.name", value=cfg.name, fix="use adamw or sgd")


def _eval_mse(model: nn.Module, data: torch.utils.data.TensorDataset) -> float:
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():  # no dropout, no RNG draws: keeps resume exact
        x, y = data.tensors
        mse = torch.nn.functional.mse_loss(model(x), y).item()
    model.train(was_training)
    return mse


class DemoTraining(Training):
    """The demo's run for core's trainer (``longboat.core.train.Training``)."""

    unit = "samples"
    resume_keys = ("model.hidden_size", "model.num_layers", "model.in_features")

    def __init__(self, cfg: Any) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader

        from longboat.core.data.sampler import StatefulDistributedSampler
        from longboat.core.device import get_accelerator
        from longboat.core.distributed import init_distributed
        from longboat.core.rng import seed_everything

        self.cfg = cfg
        self.model_cfg, self.data_cfg = cfg.model, cfg.data
        _check(self.model_cfg, self.data_cfg)
        self.accelerator = get_accelerator()
        self._threads = torch.get_num_threads()
        if self.accelerator.device_type == "cpu":
            # A 128-wide MLP gains nothing from intra-op threads, and on a busy machine
            # OpenMP threads spinning against each other make it 10-20x slower.
            torch.set_num_threads(1)
        info = init_distributed(self.accelerator)
        self.is_main = info.is_main
        self.device = self.accelerator.device()
        seed_everything(cfg.train.seed, self.accelerator)
        train_set, eval_set = synthetic_regression(self.data_cfg)
        self.eval_set = torch.utils.data.TensorDataset(
            *(t.to(self.device) for t in eval_set.tensors)
        )
        self.sampler = StatefulDistributedSampler(
            train_set, num_replicas=info.world_size, rank=info.rank, seed=self.data_cfg.seed
        )
        self.loader = DataLoader(
            train_set,
            batch_size=cfg.train.micro_batch_size,
            sampler=self.sampler,
            num_workers=0,  # the sampler position is exact only without prefetching workers
            # Iterating a DataLoader draws a seed; its own generator keeps that draw off the
            # global RNG, which would otherwise shift the dropout masks of a resumed run.
            generator=torch.Generator().manual_seed(cfg.train.seed),
        )
        self.net = build_mlp(self.model_cfg).to(self.device)
        self.model = DistributedDataParallel(self.net) if info.world_size > 1 else self.net
        self.optimizer = _optimizer(cfg.optim, self.model.parameters())
        self.items_per_step = cfg.train.micro_batch_size * info.world_size
        self.world_size = info.world_size
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
        self.autocast_dtype = dtypes.get(cfg.train.precision)

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optimizer, "sampler": self.sampler}

    def optimizers(self) -> list[Any]:
        return [self.optimizer]

    def batches(self, start_step: int) -> Iterator[Any]:
        while True:  # epochs roll over inside the (restored) sampler
            yield from self.loader

    def after_resume(self, step: int) -> None:
        self.model.train()

    def step(self, step: int, batch: Any, gate: UpdateGate) -> StepOutput:
        import torch

        from longboat.core.train import StepOutput

        x, y = (t.to(self.device) for t in batch)
        dtype = self.autocast_dtype
        with torch.autocast(
            self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None
        ):
            loss = torch.nn.functional.mse_loss(self.model(x).float(), y)
        loss.backward()
        clip = self.cfg.optim.grad_clip
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip) if clip > 0 else None
        )
        if gate.allow(step, loss, grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        epoch = step // max(1, len(self.loader))
        return StepOutput(loss=loss.detach(), grad_norm=grad_norm, metrics={"epoch": epoch})

    def evaluate(self) -> dict[str, float]:
        return {"eval_mse": _eval_mse(self.net, self.eval_set)}

    def export(self) -> Path | None:
        """The trained MLP's weights as ``model.safetensors`` in ``export.dir`` (default
        ``<output_dir>/export``)."""
        from longboat.core.hf import save_safetensors

        if not self.cfg.export.enabled:
            return None
        out = Path(self.cfg.export.dir or f"{self.cfg.output_dir}/export")
        if self.is_main:
            out.mkdir(parents=True, exist_ok=True)
            save_safetensors(self.net.state_dict(), out)
        return out

    def describe(self) -> list[str]:
        m = self.model_cfg
        return [
            f"Model mlp: {m.num_layers} layers, hidden {m.hidden_size}; data: "
            f"{self.data_cfg.num_train} samples, batch {self.items_per_step} on "
            f"{self.world_size} rank(s)."
        ]

    def report(self, result: RunResult) -> list[str]:
        lines = [f"Noise floor of the held-out MSE: {self.data_cfg.noise_std**2:.4f}"]
        done = result.stopped_by_signal is None and result.end_step >= self.cfg.train.steps
        if result.end_step > result.start_step and done:
            lines.append(
                "Run it again to see it resume from the last checkpoint; add "
                f"train.steps={2 * self.cfg.train.steps} to keep training."
            )
        return lines

    def close(self) -> None:
        import torch

        torch.set_num_threads(self._threads)


def build_training(cfg: Any) -> DemoTraining:
    """The demo's assembly: model, optimizer, data and step from a composed config."""
    from longboat.core.train import typed_config

    return DemoTraining(typed_config(cfg))


def run(cfg: Any, *, on_step: Callable[[int], None] | None = None) -> RunResult:
    """Train the demo experiment described by a composed, validated config.

    ``on_step(step)`` is called after every completed step (tests use it to deliver a
    SIGTERM at a known step).
    """
    from longboat.core.train import run_training

    return run_training(cfg, build_training, on_step=on_step)

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

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longboat.core.config.schema import DataConfig, ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["DemoResult", "MLPConfig", "SyntheticRegressionConfig", "build_mlp", "run"]


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


@dataclass
class DemoResult:
    """What a demo run did (the CLI ignores it; tests read it)."""

    start_step: int
    """Step the run started from (> 0 when it resumed)."""
    end_step: int
    """Last completed step."""
    resumed_from: Path | None
    """Checkpoint the run resumed from."""
    losses: list[float] = field(default_factory=list)
    """Training loss of every step this run took."""
    eval_before: float = math.nan
    """Held-out MSE before this run's first step."""
    eval_after: float = math.nan
    """Held-out MSE after its last step."""
    stopped_by_signal: str | None = None
    """Name of the signal that stopped the run early, if any."""
    checkpoint: Path | None = None
    """The newest checkpoint after the run."""
    metrics_path: Path | None = None
    """The metrics JSONL file."""
    plot_path: Path | None = None
    """The loss-curve PNG (None without matplotlib)."""


def _section(cfg: Any, schema: type) -> Any:
    """``cfg.model``/``cfg.data`` as ``schema`` instance, whether typed already or plain keys."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, schema):
        return cfg
    raw = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    return schema(**raw)


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


def _plot(metrics_path: Path, out: Path) -> Path | None:
    """Loss curve of every step in the JSONL (all runs so far), if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    by_step: dict[int, float] = {}
    for line in metrics_path.read_text().splitlines():
        row = json.loads(line)
        if isinstance(row.get("loss"), (int, float)):
            by_step[row["step"]] = row["loss"]  # a resumed run may repeat steps: keep the latest
    if not by_step:
        return None
    steps = sorted(by_step)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [by_step[s] for s in steps], lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("train MSE")
    ax.set_title("longboat demo: MLP on synthetic regression")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run(cfg: Any, *, on_step: Callable[[int], None] | None = None) -> DemoResult:
    """Train the demo experiment described by a composed, validated config.

    ``on_step(step)`` is called after every completed step (tests use it to
    deliver a SIGTERM at a known step).
    """
    model_cfg = _section(cfg.model, MLPConfig)
    data_cfg = _section(cfg.data, SyntheticRegressionConfig)
    _check(model_cfg, data_cfg)

    import torch

    from longboat.core.device import get_accelerator

    accelerator = get_accelerator()
    threads = torch.get_num_threads()
    if accelerator.device_type == "cpu":
        # A 128-wide MLP gains nothing from intra-op threads, and on a busy machine
        # OpenMP threads spinning against each other make it 10-20x slower.
        torch.set_num_threads(1)
    try:
        return _train(cfg, model_cfg, data_cfg, accelerator, on_step)
    finally:
        torch.set_num_threads(threads)


def _train(
    cfg: Any,
    model_cfg: MLPConfig,
    data_cfg: SyntheticRegressionConfig,
    accelerator: Any,
    on_step: Callable[[int], None] | None,
) -> DemoResult:
    import torch
    from omegaconf import DictConfig, OmegaConf
    from rich.console import Console
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from longboat.core.checkpoint import CheckpointManager
    from longboat.core.data.sampler import StatefulDistributedSampler
    from longboat.core.distributed import init_distributed
    from longboat.core.loop import (
        GracefulShutdown,
        MetricsSink,
        NaNGuard,
        StepProfiler,
        TrainProgress,
        build_lr_scheduler,
    )
    from longboat.core.rng import RNGState, seed_everything

    info = init_distributed(accelerator)
    main = info.rank == 0
    console = Console(quiet=not main)
    device = accelerator.device()
    seed_everything(cfg.train.seed, accelerator)

    train_set, eval_set = synthetic_regression(data_cfg)
    eval_set = torch.utils.data.TensorDataset(*(t.to(device) for t in eval_set.tensors))
    sampler = StatefulDistributedSampler(
        train_set, num_replicas=info.world_size, rank=info.rank, seed=data_cfg.seed
    )
    loader = DataLoader(
        train_set,
        batch_size=cfg.train.micro_batch_size,
        sampler=sampler,
        num_workers=0,  # the sampler position is exact only without prefetching workers
        drop_last=False,
        # Iterating a DataLoader draws a seed; its own generator keeps that draw off the
        # global RNG, which would otherwise shift the dropout masks of a resumed run.
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )

    net = build_mlp(model_cfg).to(device)
    model = DistributedDataParallel(net) if info.world_size > 1 else net
    optim = _optimizer(cfg.optim, model.parameters())
    total = int(cfg.train.steps)
    scheduler = build_lr_scheduler(optim, cfg.optim.schedule, total)
    guard = NaNGuard(cfg.train.nan_guard)
    state: dict[str, Any] = {
        "model": model,
        "optim": optim,
        "lr_scheduler": scheduler,
        "sampler": sampler,
        "nan_guard": guard,
        "rng": RNGState(accelerator),
        "step": 0,
    }
    config_dict = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    ckpt = CheckpointManager(cfg.checkpoint, config_dict)
    resumed = ckpt.resume(state)
    step = int(state["step"]) if resumed is not None else 0
    resumed_path = ckpt.last_loaded if resumed is not None else None
    if resumed_path is not None:
        console.print(f"[bold green]Resumed[/] from {resumed_path} (step {step}).")
    elif str(cfg.checkpoint.resume) == "auto":
        console.print(f"No checkpoint in {ckpt.dir}: starting fresh.")

    result = DemoResult(start_step=step, end_step=step, resumed_from=resumed_path)
    result.eval_before = _eval_mse(net, eval_set)
    if step >= total:
        console.print(
            f"Already at train.steps={total}: nothing to train. Continue with "
            f"[bold]longboat demo train.steps={2 * total}[/] (or start over with "
            "checkpoint.resume=none)."
        )

    run_name = str(cfg.logging.run_name)
    metrics = MetricsSink(
        cfg.logging.dir, run_name, tensorboard=bool(cfg.logging.tensorboard), enabled=main
    )
    precision = str(cfg.train.precision)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    grad_clip = float(cfg.optim.grad_clip)
    log_every = max(1, int(cfg.train.log_every))
    batches_per_epoch = len(loader)
    last_saved = resumed
    t0 = time.perf_counter()

    def batches() -> Any:
        while True:  # epochs roll over inside the sampler
            yield from loader

    model.train()
    data_iter = batches()
    with (
        GracefulShutdown() as stop,
        StepProfiler(cfg.train.profiler, Path(cfg.logging.dir) / run_name / "profile") as prof,
        TrainProgress(
            total, unit="samples", enabled=bool(cfg.logging.progress) and main, initial_step=step
        ) as progress,
    ):
        while step < total:
            prof.step(step + 1)
            x, y = (t.to(device) for t in next(data_iter))
            with torch.autocast(
                device.type,
                dtype=autocast_dtype or torch.float32,
                enabled=autocast_dtype is not None,
            ):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            if grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            else:
                grad_norm = None
            if guard.check(loss, grad_norm):
                optim.step()
                scheduler.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            state["step"] = step
            loss_value = loss.item()
            result.losses.append(loss_value)
            progress.update(step, loss=loss_value, items=x.shape[0] * info.world_size)
            if step % log_every == 0 or step == total:
                metrics.log(
                    step,
                    {
                        "loss": loss_value,
                        "lr": optim.param_groups[0]["lr"],
                        "grad_norm": grad_norm,
                        "skipped_steps": guard.total_skipped,
                        "epoch": (step - 1) // max(1, batches_per_epoch),
                    },
                )
            if on_step is not None:
                on_step(step)
            if ckpt.should_save(step):
                ckpt.save(step, state)
                last_saved = step
            if stop.should_stop():
                result.stopped_by_signal = stop.signal_name
                break
    elapsed = time.perf_counter() - t0

    if cfg.checkpoint.save_on_exit and last_saved != step:  # at the end and on SIGTERM/SIGUSR1
        ckpt.save(step, state)
        last_saved = step
    ckpt.close()
    result.end_step = step
    result.eval_after = _eval_mse(net, eval_set)
    result.checkpoint = ckpt.latest() if main else None
    tensorboard = metrics.tensorboard_enabled
    metrics.close()
    result.metrics_path = metrics.jsonl_path
    if main and result.metrics_path.is_file():
        result.plot_path = _plot(
            result.metrics_path, result.metrics_path.with_name("loss_curve.png")
        )
    if main:
        _report(console, result, cfg, ckpt.dir, elapsed, tensorboard, saved=last_saved == step)
    return result


def _report(
    console: Any,
    r: DemoResult,
    cfg: Any,
    ckpt_dir: Path,
    elapsed: float,
    tensorboard: bool,
    *,
    saved: bool,
) -> None:
    took = r.end_step - r.start_step
    if r.stopped_by_signal:
        then = (
            "checkpoint saved: run the same command again to resume."
            if saved
            else "no checkpoint (checkpoint.save_on_exit=false)."
        )
        console.print(
            f"[bold yellow]Stopped by {r.stopped_by_signal}[/] at step {r.end_step}; {then}"
        )
    if took > 0:
        head = sum(r.losses[:10]) / len(r.losses[:10])
        tail = sum(r.losses[-10:]) / len(r.losses[-10:])
        console.print(
            f"Trained steps {r.start_step + 1}..{r.end_step} in {elapsed:.1f}s. "
            f"Train loss (mean of first/last 10 steps): {head:.4f} -> {tail:.4f}"
        )
    console.print(
        f"Held-out MSE: {r.eval_before:.4f} -> {r.eval_after:.4f} "
        f"(noise floor {float(cfg.data.noise_std) ** 2:.4f})"
    )
    console.print(f"Checkpoints: {ckpt_dir} (latest: {r.checkpoint.name if r.checkpoint else '-'})")
    console.print(f"Metrics:     {r.metrics_path}")
    if tensorboard and r.metrics_path is not None:
        console.print(f"TensorBoard: tensorboard --logdir {r.metrics_path.parent / 'tensorboard'}")
    if r.plot_path is not None:
        console.print(f"Loss curve:  {r.plot_path}")
    if took > 0 and not r.stopped_by_signal and r.end_step >= int(cfg.train.steps):
        console.print(
            "Run it again to see it resume from the last checkpoint; add "
            f"train.steps={2 * int(cfg.train.steps)} to keep training."
        )

"""Typed config schemas shared by every longboat stack.

These dataclasses are the source of truth for configuration. Hydra composes YAML
config groups on top of them (see ``longboat.core.config.compose``); every key
is type-checked against these schemas and cross-field rules run in
``validate()`` before any heavy initialisation happens.

Stacks extend ``ModelConfig`` / ``DataConfig`` and the root ``ExperimentConfig``
with their own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

PARALLEL_STRATEGIES = ("ddp", "zero1", "fsdp", "hsdp")
"""``parallel.strategy``: the data-parallel strategies of torch-native stacks."""
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
"""``train.precision``."""
BASE_PRECISIONS = ("fp32", "bf16", "fp16")
"""The precisions every stack trains in (``fp8`` only where a stack declares it)."""
FP8_RECIPES = ("blockwise", "rowwise", "tensorwise", "adaptive")
"""``train.fp8.recipe``."""
RECOMPUTE_MODES = ("none", "full", "selective")
"""``train.recompute``: what each mode recomputes is the stack's (its README says; every
stack declares the modes it honours in ``Stack.capabilities``)."""
LR_SCHEDULES = ("constant", "linear", "cosine", "wsd")
"""``optim.schedule.name``."""


@dataclass
class ModelConfig:
    """Base of every model config; stacks subclass it with real fields."""

    name: str = MISSING
    """Registered model family name, e.g. ``qwen3`` or ``groot_n1_6``."""
    flavor: str = "tiny"
    """Size flavor inside the family (``tiny`` always exists)."""
    init_from: str | None = None
    """Weights to start from (null: the family's random init): a directory or native
    checkpoint in a format the stack reads (llm and vlm: a Hugging Face model directory;
    diffusion: a diffusers transformer or pipeline directory; embodied: a LeRobot, an
    Isaac-GR00T or a Hugging Face backbone directory)."""


@dataclass
class DataConfig:
    """Base of every data config; stacks subclass it."""

    name: str = "synthetic"
    """Dataset kind (stack specific)."""
    path: str | None = None
    """Dataset location on disk, if the kind reads one."""
    num_workers: int = 0
    """DataLoader worker processes."""
    seed: int = 1234
    """Seed of the data order (independent of the model seed)."""


@dataclass
class ParallelConfig:
    """How the world is split. world_size must equal tp * pp * cp * dp."""

    tensor_parallel: int = 1
    """Tensor-parallel size (must divide the number of attention heads)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (must divide the number of layers)."""
    virtual_pipeline_parallel: int | None = None
    """Interleaved virtual stages per pipeline rank (None: no interleaving)."""
    context_parallel: int = 1
    """Context-parallel size (splits the sequence)."""
    expert_parallel: int = 1
    """Expert-parallel size for MoE layers (must divide the number of experts)."""
    data_parallel: int = -1
    """Data-parallel size; -1 infers world_size / (tp * pp * cp)."""
    data_parallel_replicate: int = 1
    """HSDP: replicas across which shards are replicated (1 = pure sharding)."""
    strategy: str = "ddp"
    """Data-parallel strategy for torch-native stacks: ddp, zero1, fsdp, hsdp."""

    def model_parallel_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel


@dataclass
class LRScheduleConfig:
    """Learning-rate schedule (all kinds warm up linearly first)."""

    name: str = "cosine"
    """constant, linear, cosine or wsd."""
    warmup_steps: int = 0
    """Linear warmup from 0 to the peak LR."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak (linear / cosine / wsd)."""
    decay_steps: int | None = None
    """Steps over which to decay after warmup; None uses train.steps - warmup."""
    wsd_decay_fraction: float = 0.1
    """WSD only: fraction of the schedule spent in the final decay phase."""


@dataclass
class OptimConfig:
    """Optimizer settings."""

    name: str = "adamw"
    """adamw or sgd."""
    lr: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Max global grad norm (0 disables clipping)."""
    fused: bool = True
    """Use the fused optimizer implementation where the device has one."""
    moment_dtype: str | None = None  # type: ignore[assignment]
    """dtype of AdamW's two moments: fp32, or bf16 (2 bytes a parameter each instead of 4;
    read to fp32 and updated in fp32, stored rounded to nearest: changes numerics). bf16 is
    kept by the torch engine (embodied) with train.master_weights, and by the megatron
    engine (llm, vlm, diffusion) through the one-pass AdamW update (optim.one_pass_adamw,
    not with fp16 loss scaling or clipping across expert-parallel parts); elsewhere it is
    refused. null (the default): fp32, unless the memory plan (train.memory_budget) fits only
    with bf16 moments; a value set here is kept (pinned)."""
    one_pass_adamw: bool = True
    """Megatron stacks: the AdamW update as one kernel pass per parameter shard
    (``longboat.core.megatron.engine.one_pass_adamw``): grads read from the grad buffer,
    main weights and moments updated in place, gradient clipping on the device, the bf16
    weight written into the param buffer (no fp32 grad copy, no separate main-to-model copy,
    no host read of the grad norm). Same update rule and checkpoint state as megatron's step.
    Where it cannot apply (another optimizer than AdamW, megatron-FSDP, a quantized param
    gather) the run takes megatron's step and says why; steps with fp16 loss scaling, or
    clipping over expert-parallel parts, take megatron's step."""
    schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """The LR schedule."""


@dataclass
class NaNGuardConfig:
    """What to do when the loss or grad norm is NaN/inf."""

    enabled: bool = True
    """Skip steps whose loss or grad norm is not finite."""
    max_consecutive: int = 5
    """Abort the run after this many non-finite steps in a row."""


@dataclass
class ProfilerConfig:
    """A torch.profiler window by step range."""

    enabled: bool = False
    """Turn the profiler on."""
    start_step: int = 5
    """First profiled step (inclusive)."""
    end_step: int = 8
    """Last profiled step (inclusive)."""
    record_shapes: bool = False
    """Record operator input shapes."""


@dataclass
class Fp8Config:
    """FP8 GEMMs (``train.precision=fp8``): weights, gradients and the optimizer stay as with
    bf16; the linears of the transformer layers run their forward, input-gradient and
    weight-gradient GEMMs in FP8. The first and last layers, the LM head, norms, router and
    embeddings stay bf16."""

    recipe: str = "blockwise"
    """How operands are scaled: blockwise (1x128 activation tiles, 128x128 weight blocks, as
    DeepSeek-V3 trains), rowwise (a scale per row), tensorwise (a scale per tensor, computed
    each step) or adaptive (per GEMM shape, FP8 or bf16 by a speed measurement on the run's
    GPU, cached per shape and GPU). The default, blockwise, is provisional until the H100
    measurement picks one."""
    allow_recipe_change: bool = False
    """Resume a checkpoint trained in another precision or FP8 recipe (refused otherwise)."""


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 100
    """Optimizer steps to run."""
    micro_batch_size: int = 1
    """Samples per data-parallel rank per forward/backward."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks; None = micro_batch_size * dp."""
    seed: int = 1234
    """Seed for model init and every RNG."""
    precision: str = "bf16"
    """fp32, bf16, fp16, or fp8 (bf16 weights with FP8 GEMMs in the transformer layers'
    linears, ``train.fp8``; needs an accelerator with FP8 matmuls: CUDA compute capability
    >= 8.9, and a stack that offers it)."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """FP8 settings, read with ``precision=fp8``."""
    log_every: int = 1
    """Write metrics every N steps."""
    eval_every: int = 0
    """Run evaluation every N steps (0 disables)."""
    recompute: str = "none"
    """Activation recompute: none (keep every activation), full (recompute whole layers in
    the backward) or selective (recompute a part of each layer); which layers and parts
    each stack recomputes is in its README, and a mode a stack does not offer is refused."""
    recompute_layers: int | None = None
    """With recompute full or selective: recompute only the first ``n`` layers (blocks) of
    the model (null: every layer), where the stack offers it; unused with none."""
    recompute_components: list[str] | None = None
    """With recompute full or selective: the parts of a composed model that recompute (vlm:
    ``vision`` and / or ``language``; null: every part), where the stack offers it; unused
    with none."""
    compile: bool = False
    """torch.compile the model where the stack supports it (refused where it does not)."""
    memory_budget: str = "auto"
    """Device memory the run's memory plan fits (``longboat.core.engine.memory``): auto (about
    90% of the device's free memory when the run starts; no plan on a device that reports no
    memory, such as the CPU) or a number of GB (2^30 bytes). Where the stack plans its memory,
    the plan predicts the peak and, for the levers left unset (null), chooses per-block
    recompute, then the micro-batch split (the same global batch in more accumulated
    micro-batches), and prints one line with its choice and the predicted peak, then one with
    the measured peak after the first steps; levers set by their keys stay as set, and a run
    whose pinned levers cannot fit is refused before work with the numbers. A stack without a
    plan refuses a number."""
    cuda_graph: bool | None = None
    """Replay each training step (forward, backward, update) as one CUDA graph, captured
    after 3 eager steps: the launch overhead of thousands of small kernels goes away. null
    (the default): on where it applies (an accelerator with CUDA graphs and a step that can
    be captured: the stack's conditions, e.g. one microbatch a step, no pipeline parallelism,
    no host read in the update), else eager steps and one line saying why; true: on (an
    error where the step cannot be captured, except on an accelerator without CUDA graphs,
    where the same step runs eagerly, logged); false: eager steps."""
    nan_guard: NaNGuardConfig = field(default_factory=NaNGuardConfig)
    """Non-finite loss handling."""
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    """Optional profiler window."""
    collective_timeout_s: float = 600.0
    """Multi-process runs: seconds a rank waits in a collective (all-reduce, barrier, a
    checkpoint's gather) before it gives up. A rank that dies or hangs then stops every rank
    within about this time, with one line naming it and its last step (exit 3); a restart
    resumes from the last complete checkpoint. It applies from the first step to the end of
    the run (joining the process group and building the run wait up to 10 minutes); set it
    above the longest checkpoint save, eval or export of the run."""


@dataclass
class CheckpointConfig:
    """Native (DCP) checkpoints."""

    dir: str = "outputs/checkpoints"
    """Directory that holds step_XXXXXXXX checkpoint folders (``${output_dir}/checkpoints``
    in composed experiments)."""
    every_steps: int = 0
    """Save every N steps (0: only at the end and on signals)."""
    keep_last: int = 3
    """Keep the newest N checkpoints (0 keeps all)."""
    async_save: bool = False
    """Write checkpoints in the background."""
    resume: str = "auto"
    """auto (the latest intact checkpoint in dir), none (start over: the previous run's
    checkpoints and metrics are set aside), or the path of a checkpoint folder."""
    save_on_exit: bool = True
    """Save when training ends and when SIGTERM, SIGUSR1 or Ctrl-C stops it."""


@dataclass
class LoggingConfig:
    """Metrics and progress output."""

    dir: str = "outputs/logs"
    """Where ``<run_name>/`` with metrics.jsonl, the trackers' files, config.yaml and
    loss_curve.png goes (``${output_dir}/logs`` in composed experiments)."""
    trackers: list[str] | None = None
    """Experiment trackers beside metrics.jsonl, fed on rank 0 with the resolved config,
    every logged row and the final metrics: ``tensorboard`` (``longboat-core[tensorboard]``),
    ``wandb`` (``longboat-core[wandb]``), ``mlflow`` (``longboat-core[mlflow]``); a named
    tracker that is not installed is an error. null: tensorboard where it is installed;
    ``[]``: metrics.jsonl only."""
    project: str = "longboat"
    """The W&B project and the MLflow experiment a run is logged under."""
    wandb_mode: str = "offline"
    """offline (the run's files under ``<run_name>/wandb``, uploaded later with ``wandb
    sync``) or online (needs ``wandb login``)."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (a server, a database); null: a file store under
    ``<run_name>/mlruns``."""
    progress: bool = True
    """Show a rich progress bar on rank 0."""
    run_name: str = "run"
    """Name of this run (used in file names)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on a model's linears (``lora`` of every stack: the megatron stacks
    apply them with ``longboat.core.megatron.lora``, embodied with its own plain-torch
    adapters)."""

    enabled: bool = False
    """Train adapters only (the base weights are frozen)."""
    rank: int = 8
    """Adapter rank r."""
    alpha: float = 16.0
    """Scale numerator: the adapter output is multiplied by alpha / rank."""
    targets: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )
    """Names of the megatron linears that get adapters (attention: qkv/proj, MLP: fc1/fc2)."""


@dataclass
class EMAConfig:
    """An exponential moving average of the trained weights (``longboat.core.train.ema``),
    where the stack offers it (its ``Capabilities.ema``; other stacks refuse
    ``ema.enabled=true``)."""

    enabled: bool = False
    """Keep an fp32 average of the weights, saved in and resumed from the checkpoint."""
    decay: float = 0.9999
    """Weight of the average at each update: ``ema = decay * ema + (1 - decay) * weights``."""
    start_step: int = 0
    """Steps before this one copy the weights into the average instead (a warm start)."""
    every: int = 1
    """Update the average every this many optimizer steps."""
    export: bool = False
    """Export the average instead of the trained weights."""


EXPORT_FORMAT_AUTO = "auto"
"""``export.format`` default: the stack's own interchange format."""


@dataclass
class ExportConfig:
    """The export of the trained model when a run finishes (every stack; its format is the
    stack's: Hugging Face, diffusers, a policy directory)."""

    enabled: bool = True
    """Write the export after the last step."""
    dir: str | None = None
    """Where the export goes (null: a folder under ``output_dir`` the stack names: llm and
    vlm ``hf``, diffusion ``diffusers``, embodied ``export``)."""
    format: str = EXPORT_FORMAT_AUTO
    """Which format to write; the values are the stack's (auto: its usual one) and it
    refuses others (embodied: native, lerobot, isaac)."""
    adapter_dir: str | None = None
    """With LoRA, where the stack also writes the adapters alone as a PEFT adapter, where the
    stack offers it (null: ``<output_dir>/hf_adapter``; embodied ``<output_dir>/adapter``)."""


@dataclass
class ExperimentConfig:
    """Root config composed from the groups below."""

    experiment: str = "default"
    """Name of the recipe that produced this config."""
    stack: str = "core"
    """The stack that owns this experiment."""
    output_dir: str = "outputs/${experiment}"
    """Run directory: checkpoints (``checkpoint.dir``), metrics (``logging.dir``) and exports
    default to folders under it; a sweep (``--multirun``) gives each job its own."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    """The export of the trained model."""
    ema: EMAConfig = field(default_factory=EMAConfig)
    """An exponential moving average of the weights (where the stack offers it)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form stack extensions that have no schema yet (avoid)."""

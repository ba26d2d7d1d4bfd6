"""Typed config of embodied experiments (extends core's ``ExperimentConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from longboat.core.config.errors import ConfigError, ProblemCollector
from longboat.core.config.schema import (
    DataConfig,
    ExperimentConfig,
    LoRAConfig,
    ModelConfig,
    TrainConfig,
)
from longboat.core.engine import MASTER_WEIGHT_STRATEGIES
from longboat.core.engine.levers import (  # noqa: F401  (the stack's names for them)
    FastPath,
    check_cuda_graph_layout,
    resolve_fast_path,
)

LAYOUTS = ("v2.1", "v3.0")
VIDEO_BACKENDS = ("pyav", "torchcodec")


def export_formats() -> dict[str, list[str]]:
    """``export.format`` values and the policies each is written for (empty: any policy):
    ``auto``, ``native`` and every policy's reference formats."""
    from longboat.embodied.models.registry import policy, policy_names

    out: dict[str, list[str]] = {"auto": [], "native": []}
    for name in policy_names():
        for fmt in policy(name).export_formats:
            out.setdefault(fmt.name, []).append(name)
    return out


@dataclass
class PolicyModelConfig(ModelConfig):
    """A registered policy family, one of its flavors, and field overrides."""

    name: str = MISSING
    """The policy (``models/registry``: a policy folder's name, e.g. groot_n1_6 or pi05)."""
    flavor: str = "tiny"
    """Flavor of the family (tiny, full)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted-key overrides of the family config, e.g. {"dit.dropout": 0.0}."""
    init_from: str | None = None
    """A checkpoint to start from: a LeRobot pi0.5 policy directory (e.g. lerobot/pi05_base),
    an Isaac-GR00T N1.6 directory (its statistics.json normalises the embodiments it
    describes) or a Hugging Face backbone; a full checkpoint's config.json gives the
    architecture (model.flavor is not used) and its weights the initial values."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer directory the prompt is tokenised with: pi05, PaliGemma's
    for released checkpoints (LeRobot's prompt: task + state as text); groot_n1_6, the
    nvidia/Eagle-Block2A-2B-v2 one (Isaac-GR00T N1.6's chat prompt with Eagle's image
    tokens). null: the tokenizer in model.init_from, if it holds one. Required for a
    pretrained pi0.5 and for GR00T from the released Eagle backbone; from-scratch runs
    without one use the policy's stand-in (pi05: a byte-level BPE written into
    <output_dir>/tokenizer and shipped with the export; groot_n1_6: the byte-level stand-in
    tokenizer). ``byte``: the byte-level stand-in tokenizer."""


@dataclass
class SyntheticDataConfig:
    """The synthetic LeRobot dataset generated on first use when data.path is null."""

    layout: str = "v3.0"
    """LeRobot layout to write: v2.1 or v3.0."""
    num_episodes: int = 8
    """Episodes per embodiment."""
    episode_length: int = 24
    """Frames per episode."""
    num_embodiments: int = 1
    """Embodiments (each its own dataset under the root when > 1)."""
    seed: int = 0
    """Seed of the generated values."""


@dataclass
class LeRobotDataConfig(DataConfig):
    """A LeRobot dataset (v2.1 or v3.0) read frame-accurately."""

    name: str = "lerobot"
    """Dataset kind (only lerobot)."""
    path: str | None = None
    """Dataset root; null generates the synthetic dataset into <output_dir>/dataset."""
    video_backend: str = "pyav"
    """Frame decoder: pyav or torchcodec."""
    shuffle: bool = True
    """Shuffle the sample order (deterministic in data.seed, resumable)."""
    skip_bad_samples: bool = False
    """Skip (and count) samples that fail to decode, and frames whose values lie far outside
    the dataset's stats.json range (a corrupt file), instead of failing the run."""
    cameras: list[str] | None = None
    """Camera keys the policy sees, in this order (e.g. [observation.images.front,
    observation.images.wrist]); null: every camera of the dataset in info.json order. An
    unknown key fails before the model is built."""
    verify: bool = False
    """Scan the dataset at startup: every data file reads in full, every video opens and
    holds the frames of its episodes; prints a summary and fails listing every problem."""
    eval_episodes: Any = None
    """Held-out episodes, excluded from training and evaluated at ``train.eval_every`` steps
    (and at the start and end of the run): a list of episode indices (held out of every
    sub-dataset that has them), or a fraction in (0, 1), the last ``round(f * n)`` (at least
    one) of the n episodes of each sub-dataset by episode index (0.1: the last 10%). null: no
    held-out set, no evaluation. An index no sub-dataset has, or a held-out set that leaves a
    sub-dataset no training episode, fails before the model is built."""
    eval_batches: int = 4
    """Batches of train.micro_batch_size samples one evaluation runs, spread evenly over the
    held-out frames (fewer when the held-out set is smaller); the same samples, noise and
    flow-matching times at every evaluation, at any data-parallel size and after a resume."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    """Settings of the generated dataset (used only when path is null)."""


@dataclass
class SimEvalConfig:
    """Closed-loop evaluation in a simulated suite during training (needs
    ``longboat-embodied[sim]``): at every ``train.eval_every`` steps (after the first
    evaluation) and at the end, the current weights roll out in a child process, so that a
    simulator crash never stops training (a failed evaluation is logged as such), and
    ``sim_success_rate`` is logged beside the loss (``longboat.embodied.eval.in_training``).
    Training waits for the child: with several ranks keep ``train.collective_timeout_s``
    above ``timeout_s``."""

    suite: str | None = None
    """A built-in suite (pusht) or the path of a suite YAML; null: no closed-loop eval."""
    episodes: int = 10
    """Episodes per task of the suite."""
    num_envs: int = 1
    """Environments stepped together."""
    max_steps: int | None = None
    """Steps per episode at most; null: the suite's ``max_episode_steps``."""
    videos: int = 1
    """Episodes per task recorded as mp4 (``<output_dir>/sim_eval/step_<N>/videos``)."""
    seed: int = 0
    """Episode k of each evaluation resets with seed + k (the same scenes every time)."""
    device: str = "cpu"
    """The device the child runs the policy on (cpu, cuda, ...)."""
    timeout_s: float = 1800.0
    """Seconds one evaluation may take before it is stopped and logged as failed."""


@dataclass
class EmbodiedTrainConfig(TrainConfig):
    """The embodied training loop (core's fields plus embodied-only switches).

    ``global_batch_size`` is the samples per optimizer step over all ranks and stays fixed
    when the data-parallel size changes (null: micro_batch_size x data-parallel size); each
    rank accumulates global / (micro x dp) micro-batches, and every micro-batch's RNG is
    seeded from (seed, step, micro-batch index), so any data-parallel size trains the same
    math.
    """

    compile: bool = False
    """``torch.compile`` every parallel block of the policy (``parallel_blocks()``: ViT, LM
    and DiT / expert blocks; after activation checkpointing and the data-parallel wrapping),
    compiled on first use; off by default. pi0.5's joint layers run through their
    ``project_qkv`` / ``finish`` methods, which stay eager."""
    recompute: str | None = None  # type: ignore[assignment]
    """Activation recompute of the policy's blocks (ViT, LM, DiT / expert layers): none,
    selective (every second block) or full (every block). null (the default): the memory
    plan chooses (``train.memory_budget``): none where everything fits, else selective, else
    full; none where there is no plan (auto on a device without memory of its own, e.g. the
    CPU). A value set here is kept (pinned); the plan refuses a pinned run that cannot fit."""
    master_weights: bool | None = None
    """With precision=bf16: store trainable params in bf16 (views of one flat buffer,
    grads in one flat bf16 buffer) with fp32 master weights and Adam moments in the
    optimizer (``MasterWeightAdamW``); false keeps fp32 params under bf16 autocast.
    parallel.strategy=ddp only (all-reduced by the optimizer in one collective). null (the
    default): on where it applies (precision=bf16, parallel.strategy=ddp, optim.name=adamw);
    a bf16 run it cannot apply to says why on its Policy line."""
    master_weight_storage: str | None = None  # type: ignore[assignment]
    """How train.master_weights stores the fp32 masters: split (the bf16 weights plus an
    int16 low half per parameter: the exact fp32 masters in 2 bytes a parameter less, 3.2 GB
    for 1.6B trainable parameters; the bf16 weights round ties away from zero instead of to
    even) or fp32 (a separate fp32 buffer). The optimizer's math and its checkpoints are the
    same for both (a checkpoint of one resumes in the other). bf16_sr: no masters at all (4
    bytes a parameter less than fp32): the update runs in fp32 from the bf16 weight and is
    rounded back stochastically with noise derived from (train.seed, step, element), so runs
    and resumes reproduce exactly; changes numerics (the memory plan picks it only where
    nothing else fits). null (the default): split, unless the memory plan
    (train.memory_budget) fits only with bf16_sr; a value set here is kept (pinned)."""
    master_weight_update: str = "kernel"
    """How train.master_weights updates: kernel (the default: one Triton pass per param group
    reading the bf16 grads and writing masters, moments and bf16 weights, ~26 instead of ~85
    bytes a parameter with split storage, no scratch; where Triton does not run compiled, e.g.
    on CPU, the slices) or slices (per 32M-element slice a grad cast into an fp32 scratch and
    torch's fused AdamW, then the master -> bf16 copy). Same update rule either way."""
    cuda_graph: bool | None = None
    """Replay each training step (forward, backward, clip, AdamW update) as one CUDA graph
    (core's ``GraphedStep``, captured after 3 eager steps); batches are padded to fixed
    shapes. Needs train.master_weights and no gradient accumulation (global batch = micro
    batch x data-parallel size, or null). null (the default): on where it applies (those two,
    a CUDA device, one data-parallel rank, no activation checkpointing or compile), falling
    back to eager steps with a notice if the step synchronises with the host; true where it
    cannot apply is an error, except on a device without CUDA graphs (eager, logged); true
    with data parallelism captures the gradient all-reduce too."""
    sim_eval: SimEvalConfig = field(default_factory=SimEvalConfig)
    """Closed-loop evaluation in simulation during training (``suite`` null: off)."""


@dataclass
class EmbodiedLoRAConfig(LoRAConfig):
    """Low-rank adapters on the policy's linears (``longboat.embodied.train.lora``): only
    the adapters train, the export holds the merged weights and the adapters also go out as
    a PEFT adapter (``export.adapter_dir``, null: ``<output_dir>/adapter``)."""

    targets: list[str] = field(default_factory=list)
    """Linears that get adapters, named as PEFT's ``target_modules`` (a module path or its
    last parts, e.g. q_proj or action_head.model.to_q); empty: the policy's defaults (its
    language model's attention / MLP and its action head's linears)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (PEFT's ``lora_dropout``)."""


@dataclass
class EmbodiedExperimentConfig(ExperimentConfig):
    """Root config of an embodied experiment. Under core's ``output_dir`` (the run
    directory): ``checkpoints/``, ``logs/``, the generated ``dataset/`` (data.path null) and
    ``export/``."""

    stack: str = "embodied"
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    data: LeRobotDataConfig = field(default_factory=LeRobotDataConfig)
    train: EmbodiedTrainConfig = field(default_factory=EmbodiedTrainConfig)
    lora: EmbodiedLoRAConfig = field(default_factory=EmbodiedLoRAConfig)
    """Low-rank adapters (``lora.enabled``: only the adapters train)."""


def validate_embodied(cfg: Any, world_size: int | None, problems: ProblemCollector) -> None:
    """Embodied-specific checks (core's validator runs the generic ones)."""
    from longboat.embodied.models.registry import policy

    model_name = cfg.model.get("name") if "model" in cfg else None
    if isinstance(model_name, str):
        try:
            policy(model_name)
        except ConfigError as err:
            problems.extend(err)
            model_name = None
    data = cfg.get("data")
    if data is not None:
        backend = data.get("video_backend")
        if backend is not None and backend not in VIDEO_BACKENDS:
            problems.add(
                "data.video_backend",
                "unknown video decoder",
                value=backend,
                fix=f"use one of {', '.join(VIDEO_BACKENDS)}",
            )
        synthetic = data.get("synthetic")
        if synthetic is not None and synthetic.get("layout") not in LAYOUTS:
            problems.add(
                "data.synthetic.layout",
                "unknown LeRobot layout",
                value=synthetic.get("layout"),
                fix=f"use one of {', '.join(LAYOUTS)}",
            )
    check_export_keys(cfg, model_name, problems)
    check_lora_keys(cfg, problems, model_name)
    eval_episodes = None if data is None else data.get("eval_episodes")
    if data is not None:
        check_eval_keys(eval_episodes, data.get("eval_batches", 4), problems)
    train = cfg.get("train")
    sim_eval = train.get("sim_eval") if train is not None else None
    sim_suite = sim_eval.get("suite") if sim_eval is not None else None
    every = (train.get("eval_every") or 0) if train is not None else 0
    if every > 0 and eval_episodes is None and sim_suite is None:
        problems.add(
            "train.eval_every",
            "evaluates held-out episodes or a simulated suite, but data.eval_episodes is "
            "null (no held-out set) and so is train.sim_eval.suite",
            value=train.get("eval_every"),
            fix="hold episodes out with data.eval_episodes=0.1 (the last 10%) or "
            "data.eval_episodes=[0,1], evaluate in simulation with "
            "train.sim_eval.suite=pusht, or set train.eval_every=0",
        )
    if sim_eval is not None:
        check_sim_eval_keys(sim_eval, problems)
    if train is not None and train.get("master_weight_storage") not in (
        None,
        "split",
        "fp32",
        "bf16_sr",
    ):
        problems.add(
            "train.master_weight_storage",
            "unknown master-weight storage",
            value=train.get("master_weight_storage"),
            fix="use split or fp32 (exact fp32 masters), or bf16_sr (no masters: stochastic "
            "rounding, changes numerics)",
        )
    optim = cfg.get("optim")
    low_storage = {
        "optim.moment_dtype": None if optim is None else optim.get("moment_dtype"),
        "train.master_weight_storage": None
        if train is None
        else train.get("master_weight_storage"),
    }
    for key, value in low_storage.items():
        if value not in ("bf16", "bf16_sr") or train is None:
            continue
        if train.get("master_weights") is False or train.get("precision") != "bf16":
            problems.add(
                key,
                "is kept by the master-weight optimizer, which this run does not use",
                value=value,
                fix="set train.precision=bf16 and train.master_weights=true (or null), or "
                + ("optim.moment_dtype=fp32" if key.startswith("optim") else
                   "train.master_weight_storage=split"),
            )  # fmt: skip
    if train is not None and train.get("master_weight_update", "kernel") not in (
        "slices",
        "kernel",
    ):
        problems.add(
            "train.master_weight_update",
            "unknown master-weight update",
            value=train.get("master_weight_update"),
            fix="use slices or kernel",
        )
    if train is not None and train.get("master_weights"):
        strategy = cfg.parallel.get("strategy") if "parallel" in cfg else None
        if strategy is not None and strategy not in MASTER_WEIGHT_STRATEGIES:
            problems.add(
                "train.master_weights",
                f"is not supported with parallel.strategy={strategy} (sharded or wrapped params "
                "cannot be views of one flat buffer)",
                value=True,
                fix=f"set parallel.strategy={' or '.join(MASTER_WEIGHT_STRATEGIES)} or "
                "train.master_weights=false",
            )
        if train.get("precision") != "bf16":
            problems.add(
                "train.master_weights",
                "keeps bf16 params, so it needs bf16 autocast",
                value=True,
                fix="set train.precision=bf16 or train.master_weights=false",
            )
        if (cfg.optim.get("name") if "optim" in cfg else "adamw") != "adamw":
            problems.add(
                "train.master_weights",
                "is implemented for AdamW only",
                value=True,
                fix="set optim.name=adamw or train.master_weights=false",
            )
    if train is not None:
        check_cuda_graph_layout(train, world_size, problems, stack="embodied")


def check_lora_keys(cfg: Any, problems: ProblemCollector, model_name: Any = None) -> None:
    """``lora.*`` / ``export.adapter_dir``: a rank below 1, a dropout outside [0, 1), an
    adapter folder without LoRA, targets matching no linear of
    ``model_name``'s flavor (built on the meta device: no weights allocated)."""
    lora = cfg.get("lora")
    export = cfg.get("export")
    adapter = export.get("adapter_dir") if export is not None else None
    enabled = lora is not None and bool(lora.get("enabled"))
    if adapter is not None and not enabled:
        problems.add(
            "export.adapter_dir",
            "the embodied stack writes an adapter only with LoRA",
            value=adapter,
            fix="set lora.enabled=true, or leave export.adapter_dir null",
        )
    if not enabled:
        return
    if not isinstance(lora.get("rank"), int) or lora.get("rank") < 1:
        problems.add("lora.rank", "must be >= 1", value=lora.get("rank"), fix="e.g. lora.rank=16")
    dropout = lora.get("dropout")
    if not 0.0 <= float(dropout) < 1.0:
        problems.add(
            "lora.dropout", "must be in [0, 1)", value=dropout, fix="e.g. lora.dropout=0.05"
        )
    targets = list(lora.get("targets") or [])
    if targets and isinstance(model_name, str):
        check_lora_targets(cfg, model_name, targets, problems)


def check_lora_targets(
    cfg: Any, model_name: str, targets: list[str], problems: ProblemCollector
) -> None:
    """``lora.targets`` that match no ``nn.Linear`` of the policy's flavor (a flavor or
    override the policy refuses is reported by the run that builds it)."""
    import torch

    from longboat.embodied.models import build_model, get_config
    from longboat.embodied.train.lora import match_targets

    model = cfg.model
    try:
        with torch.device("meta"):
            policy_cfg = get_config(
                model_name, model.get("flavor"), dict(model.get("overrides") or {})
            )
            built = build_model(model_name, policy_cfg)
    except Exception:  # the run's own build names what is wrong
        return
    empty = [t for t, names in match_targets(built, targets).items() if not names]
    if empty:
        problems.add(
            "lora.targets",
            f"{empty} match no nn.Linear of the {model_name} policy",
            value=targets,
            fix="name linears by module path or its last parts, e.g. q_proj, v_proj; "
            "[] takes the policy's defaults",
        )


def check_export_keys(cfg: Any, model_name: Any, problems: ProblemCollector) -> None:
    """``export.format`` fits ``model.name`` (the stack's capabilities refuse an unknown
    one)."""
    export = cfg.get("export")
    fmt = export.get("format", "auto") if export is not None else "auto"
    if fmt in ("auto", "native"):
        return
    formats = export_formats()
    if fmt in formats and isinstance(model_name, str) and model_name not in formats[fmt]:
        problems.add(
            "export.format",
            f"{fmt} is written for {', '.join(formats[fmt])}, not model.name={model_name}",
            value=fmt,
            fix="use export.format=auto (other layouts of an export: python -m "
            "longboat.embodied.train.lerobot_export --help)",
        )


def check_eval_keys(eval_episodes: Any, eval_batches: Any, problems: ProblemCollector) -> None:
    """The shape of ``data.eval_episodes`` (null, a fraction in (0, 1) or a non-empty list of
    distinct episode indices >= 0) and ``data.eval_batches`` (>= 1); whether the indices exist
    is checked when the dataset's metadata is read (``datasets.held_out_episodes``)."""
    value = eval_episodes
    if hasattr(value, "__iter__") and not isinstance(value, str):
        value = list(value)
    if isinstance(value, list):
        bad = [e for e in value if isinstance(e, bool) or not isinstance(e, int) or e < 0]
        if bad or not value or len(set(value)) != len(value):
            what = (
                f"holds {bad}, not episode indices (integers >= 0)"
                if bad
                else "must list at least one episode, each once"
            )
            problems.add(
                "data.eval_episodes",
                what,
                value=value,
                fix="list episode indices, e.g. data.eval_episodes=[0,5], or give a fraction "
                "such as data.eval_episodes=0.1, or null for no held-out set",
            )
    elif value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1
    ):
        problems.add(
            "data.eval_episodes",
            "must be a fraction in (0, 1) of each sub-dataset's episodes, a list of episode "
            "indices, or null",
            value=value,
            fix="e.g. data.eval_episodes=0.1 (the last 10% of episodes) or "
            f"data.eval_episodes=[{value if isinstance(value, int) and value >= 0 else 0}]",
        )
    if isinstance(eval_batches, bool) or not isinstance(eval_batches, int) or eval_batches < 1:
        problems.add(
            "data.eval_batches",
            "must be a positive number of batches",
            value=eval_batches,
            fix="set data.eval_batches=4 (or any integer >= 1)",
        )


def check_sim_eval_keys(sim_eval: Any, problems: ProblemCollector) -> None:
    """``train.sim_eval``: a suite that exists and whose simulator is installed (the
    ``sim`` extra), positive counts and timeout."""
    for key in ("episodes", "num_envs"):
        value = sim_eval.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.add(f"train.sim_eval.{key}", "must be >= 1", value=value, fix="e.g. 4")
    for key in ("videos", "seed"):
        value = sim_eval.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.add(f"train.sim_eval.{key}", "must be >= 0", value=value, fix="e.g. 0")
    steps = sim_eval.get("max_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        problems.add(
            "train.sim_eval.max_steps", "must be >= 1 or null", value=steps, fix="e.g. 300"
        )
    timeout = sim_eval.get("timeout_s")
    if not isinstance(timeout, int | float) or timeout <= 0:
        problems.add("train.sim_eval.timeout_s", "must be > 0", value=timeout, fix="e.g. 1800")
    name = sim_eval.get("suite")
    if name is None:
        return
    from longboat.embodied.eval.suite import check_installed, load_suite

    try:
        check_installed(load_suite(str(name), key="train.sim_eval.suite"), "train.sim_eval.suite")
    except ConfigError as err:
        problems.extend(err)

"""Typed config of LLM training runs: the root schema, LoRA, export and the data kinds."""

from __future__ import annotations

from dataclasses import dataclass, field

from longboat.core.config.schema import DataConfig, ExperimentConfig, TrainConfig
from longboat.core.config.schema import LoRAConfig as CoreLoRAConfig


@dataclass
class QuickstartDataConfig(DataConfig):
    """Text the package ships (longboat's own docs and source), tokenized by a BPE trained here."""

    name: str = "quickstart"
    out_dir: str = "outputs/quickstart/data"
    """Where the corpus, tokenizer and token files are written (reused when present)."""
    vocab_size: int = 1024
    """BPE vocabulary size (must be <= model.vocab_size)."""
    seq_len: int = 128
    """Tokens per packed training row (must be <= model.max_position_embeddings)."""
    eval_fraction: float = 0.05
    """Fraction of documents held out for evaluation."""
    max_chars: int = 2_000_000
    """Upper bound on the characters read into the corpus."""
    document_attention: bool = True
    """Mask attention between documents packed into one row (block-diagonal causal)."""


DATA_FORMATS = ("auto", "pretrain", "sft")
"""``data.format`` of raw inputs: auto (records in a chat form are sft)."""


@dataclass
class PreparedDataConfig(DataConfig):
    """Token datasets written by ``longboat-llm data prepare`` (or the quickstart layout)."""

    name: str = "prepared"
    paths: list[str] = field(default_factory=list)
    """One entry per source: a dataset ``longboat-llm data prepare`` wrote, or a raw JSONL /
    Parquet file or folder or ``datasets`` folder, tokenised on first use into
    ``data.cache_dir`` and reused while it is unchanged."""
    format: str = "auto"
    """What raw inputs hold: auto (records in a chat form, ``messages``, ShareGPT
    ``conversations``, Alpaca ``instruction`` / ``output`` or ``prompt`` / ``completion``, are
    sft: loss on the assistant's tokens; others pretrain text), pretrain or sft."""
    columns: dict[str, str] = field(default_factory=dict)
    """Your record keys under the names longboat reads, for raw inputs: ``{messages: dialog}``,
    ``{prompt: question, completion: answer}``, ``{text: body}`` (keys: messages,
    conversations, instruction, input, output, prompt, completion, system, text)."""
    cache_dir: str | None = None
    """Where raw inputs are prepared (null: ``~/.cache/longboat/datasets``)."""
    weights: list[float] | None = None
    """Blend weight per path (None: proportional to size)."""
    tokenizer: str | None = None
    """Hugging Face tokenizer directory (saved with the HF export; null with
    ``model.init_from``: the checkpoint's)."""
    seq_len: int = 2048
    """Tokens per packed training row (must be <= model.max_position_embeddings)."""
    eval_fraction: float = 0.01
    """Fraction of documents held out for evaluation."""
    document_attention: bool = True
    """Mask attention between documents packed into one row (block-diagonal causal)."""


@dataclass
class SyntheticTokensDataConfig(DataConfig):
    """Random tokens (uniform over the model's vocabulary): throughput runs and smoke tests
    without a corpus. No tokenizer, so no generation from the export."""

    name: str = "synthetic"
    num_documents: int = 4096
    """Documents of ``seq_len`` tokens each (one packed row apiece)."""
    seq_len: int = 2048
    """Tokens per packed training row (must be <= model.max_position_embeddings)."""
    eval_fraction: float = 0.0
    """Fraction of documents held out for evaluation (0: no held-out loss)."""
    document_attention: bool = False
    """Mask attention between documents packed into one row (one document a row here)."""


@dataclass
class LoRAConfig(CoreLoRAConfig):
    """Low-rank adapters on the attention and MLP linears (core's fields + a PEFT start)."""

    init_from: str | None = None
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) to
    start the adapters from, e.g. one an earlier run exported (null: B = 0, A random)."""


OBJECTIVES = ("lm", "dpo")
"""``llm.objective``: lm (next-token cross-entropy: pretraining, or SFT on chat data, as
``data.format`` says) or dpo (direct preference optimisation on ``chosen`` / ``rejected``
pairs)."""

DPO_REFERENCES = ("initial",)
"""``llm.dpo.reference``: initial (the run's initial weights, frozen)."""


@dataclass
class DPOConfig:
    """Direct preference optimisation (``llm.objective=dpo``)."""

    beta: float = 0.1
    """Strength of the pull toward the reference model: the loss is
    ``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` over each pair's summed answer
    log-probabilities (larger: stay closer to the reference)."""
    reference: str = "initial"
    """The reference model: initial (the weights the run starts from, ``model.init_from`` or
    the seed's; their log-probabilities are computed once before the first step and kept in
    the checkpoint)."""


@dataclass
class LLMRunConfig:
    """LLM-specific run settings."""

    objective: str = "lm"
    """What the run trains: lm (next-token cross-entropy; pretraining or SFT, as the data
    says) or dpo (preference pairs in ``data.paths``; see ``llm.dpo``)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Settings of ``llm.objective=dpo``."""

    cpu_precision: str = "fp32"
    """Precision used instead of train.precision when running on CPU (bf16 is slow there)."""
    eval_batches: int = 2
    """Global batches of the held-out split per evaluation."""
    generate_prompt: str | None = None
    """After export, load it with transformers and greedily continue this prompt (None: skip)."""
    generate_chat: bool | None = None
    """Feed ``generate_prompt`` as a user turn through the tokenizer's chat template and print
    the answer (null: when the run trains on chats and the tokenizer has a template)."""
    generate_tokens: int = 40
    """Tokens generated from ``generate_prompt``."""
    generate_repetition_penalty: float = 1.0
    """transformers' repetition penalty for that generation (1.0: plain greedy)."""
    num_threads: int = 0
    """torch intra-op threads on CPU (0: leave torch's default)."""
    fused_linear_ce: bool = True
    """Compute the LM loss with fused linear cross-entropy (``longboat.kernels``) through
    GPTModel's output hook: no ``[tokens, vocab]`` logits. Used where the full vocabulary and
    all tokens are on the rank (tensor/sequence/context parallel 1); the logits path
    elsewhere and when false."""
    wgrad_fusion: bool = True
    """bf16: weight-gradient GEMMs accumulate straight into megatron's grad buffer
    (``longboat.core.megatron.wgrad_fusion``; no per-parameter add pass). With one microbatch per
    step and DP / CP / PP 1 the buffer is bf16 (same gradient values, half the memory),
    otherwise fp32 (the GEMM accumulates its fp32 product). Off with ``train.compile``."""


@dataclass
class LLMTrainConfig(TrainConfig):
    """The LLM training loop (core's fields; ``recompute`` left to the memory plan)."""

    recompute: str | None = None  # type: ignore[assignment]
    """Activation recompute: none, selective (each layer's core attention) or full (whole
    layers; with ``recompute_layers`` the first n of each pipeline stage). null (the
    default): the memory plan chooses (``train.memory_budget``): none where everything fits,
    else selective, else full, then a smaller micro-batch; none where there is no budget
    (auto on a device without memory of its own, e.g. the CPU). A value set here is kept
    (pinned); a pinned run that cannot fit its budget is refused before work."""


@dataclass
class LLMExperimentConfig(ExperimentConfig):
    """Root config of ``longboat-llm train``."""

    stack: str = "llm"
    train: LLMTrainConfig = field(default_factory=LLMTrainConfig)
    """The training loop."""
    llm: LLMRunConfig = field(default_factory=LLMRunConfig)
    """LLM run settings (eval, generation, kernels, levers)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters."""

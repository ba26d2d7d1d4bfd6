"""Helpers shared by the embodied tests (not a test module: no ``test_`` prefix; importable
because conftest.py puts this folder on ``sys.path``): the tiny GR00T model with its
optimizer on a one-process CPU setup, its synthetic batches, ``train_step`` as those tests
call it, the update gate of a plain LR schedule, and a run's metrics rows."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from longboat.core.config.schema import NaNGuardConfig, OptimConfig
from longboat.core.engine.torch.step import StepResult, train_step
from longboat.core.loop.nan_guard import NaNGuard
from longboat.core.train.gate import UpdateGate
from longboat.embodied.models import apply_freezing, build_model
from longboat.embodied.models.synthetic import synthetic_batch
from longboat.embodied.parallel import ParallelSetup, build_optimizer, parallelize

SETUP = ParallelSetup(strategy="ddp", world_size=1, rank=0)


def read_metrics(out: Path, run: str) -> list[dict]:
    """The rows of ``<out>/logs/<run>/metrics.jsonl``."""
    path = out / "logs" / run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def tiny_run_overrides(out: Path, *extra: str) -> list[str]:
    """Overrides of a 2-step ``groot_n1_6_tiny`` run in bf16 at ``out``: one micro-batch of 2 a
    step, a 2-episode synthetic dataset, no progress bar, TensorBoard or exit checkpoint;
    ``extra`` overrides follow (and win)."""
    return [
        f"output_dir={out}",
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",  # micro x dp: one micro-batch a step
        "train.precision=bf16",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.save_on_exit=false",
        "data.synthetic.num_episodes=2",
        "data.synthetic.episode_length=12",
        *extra,
    ]


def tiny_groot(
    optim: OptimConfig, *, master_weights: bool = True, storage: str = "fp32"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``groot_n1_6`` tiny, seed 0, frozen as configured, bf16 on ``SETUP``, and its optimizer
    (``MasterWeightAdamW`` with ``storage`` when ``master_weights``)."""
    torch.manual_seed(0)
    model = build_model("groot_n1_6", "tiny")
    apply_freezing(model)
    model = parallelize(model, SETUP, precision="bf16", master_weights=master_weights)
    optimizer = build_optimizer(
        model, optim, SETUP, master_weights=master_weights, master_storage=storage
    )
    return model, optimizer


def tiny_groot_batches(count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` synthetic batches of 2 for the tiny GR00T (seed 1)."""
    torch.manual_seed(1)
    model = build_model("groot_n1_6", "tiny")
    return [synthetic_batch(model, 2) for _ in range(count)]


def schedule_gate(schedule) -> UpdateGate:
    """Core's synchronous gate with the NaN guard off: every update is taken and advances
    ``schedule`` (anything with ``step()``: a ``LambdaLR``, core's ``RunSchedule``)."""
    return UpdateGate(NaNGuard(NaNGuardConfig(enabled=False)), schedule)


def cpu_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    step: int,
    grad_clip: float,
    gate: UpdateGate | None = None,
    **kwargs,
) -> StepResult:
    """``train_step`` on one micro-batch, on CPU in bf16 autocast, seed 3, rank offset 0,
    then ``gate.end_step()`` as core's trainer calls it (the schedule advances when the
    update was taken); ``kwargs`` pass through."""
    result = train_step(
        model,
        optimizer,
        [batch],
        step=step,
        seed=3,
        rank_offset=0,
        device_type="cpu",
        precision="bf16",
        grad_clip=grad_clip,
        gate=gate,
        **kwargs,
    )
    if gate is not None:
        gate.end_step()
    return result


def write_tiny_tokenizer(directory: Path, vocab_size: int = 400, extra_tokens: int = 0) -> Path:
    """A small Gemma-style tokenizer saved with ``save_pretrained`` (``PreTrainedTokenizerFast``):
    ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2 prepended to every text, ``<unk>`` 3, and a byte-level
    BPE trained on a few robot prompts, so any text (digits, newlines) tokenises. Built
    locally, nothing downloaded; at most ``vocab_size`` ids, plus ``extra_tokens`` added
    tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        f"Task: pick up the {thing} and place it in the {where}, State: {' '.join(map(str, range(i, 256, 37)))};\nAction: "
        for i, (thing, where) in enumerate(
            [("red cube", "bowl"), ("cup", "sink"), ("green block", "box"), ("towel", "basket")]
        )
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
    fast.save_pretrained(str(directory))
    return Path(directory)


def write_tiny_qwen_tokenizer(
    directory: Path, *, image_token_id: int = 511, image_tokens: bool = True
) -> Path:
    """A small Qwen-style tokenizer saved with ``save_pretrained``: a byte-level BPE trained
    on a few robot tasks (no BOS added), then ``<|endoftext|>`` (the pad token),
    ``<|im_start|>``, ``<|im_end|>``, reserved fillers and, ending at ``image_token_id``,
    ``<img>``, ``</img>``, ``<IMG_CONTEXT>`` (Eagle's image tokens; left out with
    ``image_tokens=False``). Built locally, nothing downloaded; the tiny GR00T's vocabulary
    of 512 holds every id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        f"{verb} the {thing} and put it in the {where}\nyou are a helpful assistant"
        for verb, thing, where in [
            ("pick up", "red cube", "bowl"),
            ("grasp", "cup", "sink"),
            ("stack", "green block", "box"),
            ("fold", "towel", "basket"),
        ]
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus * 4, trainer)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    image = ["<img>", "</img>", "<IMG_CONTEXT>"] if image_tokens else []
    first_image = image_token_id - 2
    fillers = first_image - tok.get_vocab_size() - len(specials)
    names = specials + [f"<|reserved_{i}|>" for i in range(fillers)] + image
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    if image_tokens:
        assert fast.convert_tokens_to_ids("<IMG_CONTEXT>") == image_token_id
    fast.save_pretrained(str(directory))
    return Path(directory)

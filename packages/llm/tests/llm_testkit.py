"""Tiny datasets and configs for tests of ``longboat-llm train`` (CPU, seconds)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TINY_MODEL = [
    "model.vocab_size=256",
    "model.hidden_size=64",
    "model.num_layers=4",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.head_dim=16",
    "model.ffn_hidden_size=128",
    "model.max_position_embeddings=64",
]


def make_tiny_dataset(root: Path, *, docs: int = 120) -> tuple[Path, Path]:
    """(prepared dataset dir, tokenizer dir) of short synthetic sentences, vocab <= 256."""
    from longboat.llm.data.prepare import PrepareOptions, prepare_dataset
    from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

    words = ["boat", "sail", "wind", "oar", "sea", "tide", "row", "mast", "deck", "crew"]
    texts = [
        " ".join(words[(i * 7 + j * (i % 5 + 1)) % len(words)] for j in range(5 + i % 23))
        for i in range(docs)
    ]
    root.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(texts, root / "tokenizer", vocab_size=256)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    opts = PrepareOptions(input=corpus, tokenizer=Path(tok), output=root / "tokens")
    prepare_dataset(opts, log=lambda *_: None, progress=False)
    return root / "tokens", Path(tok)


def make_tiny_sft_dataset(root: Path, *, records: int = 80) -> tuple[Path, Path]:
    """(SFT dataset dir, tokenizer dir): short chats whose answers follow from the question."""
    from longboat.llm.data.prepare import PrepareOptions, prepare_dataset
    from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

    chats = [
        [
            {"role": "user", "content": f"count from {i % 7} please"},
            {"role": "assistant", "content": " ".join(str((i % 7) + k) for k in range(4))},
        ]
        for i in range(records)
    ]
    root.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(
        [m["content"] for c in chats for m in c], root / "tokenizer", vocab_size=256
    )
    corpus = root / "chats.jsonl"
    corpus.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    opts = PrepareOptions(input=corpus, tokenizer=Path(tok), output=root / "sft", format="sft")
    prepare_dataset(opts, log=lambda *_: None, progress=False)
    return root / "sft", Path(tok)


def tiny_overrides(data_dir: Path, tokenizer: Path, out: Path, *, steps: int = 10) -> list[str]:
    """Overrides of the ``quickstart`` experiment: the tiny model on a prepared dataset."""
    return [
        *TINY_MODEL,
        "data=prepared",
        f"data.paths=[{data_dir}]",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=32",
        "data.eval_fraction=0.1",
        f"train.steps={steps}",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.eval_every=0",
        "train.log_every=1",
        "optim.lr=0.01",
        "optim.schedule.warmup_steps=2",
        f"checkpoint.dir={out}/ckpt",
        "checkpoint.every_steps=0",
        "checkpoint.save_on_exit=false",
        "checkpoint.resume=none",
        f"logging.dir={out}/logs",
        "logging.progress=false",
        "logging.trackers=[]",
        "export.enabled=false",
        "llm.generate_prompt=null",
        "llm.eval_batches=1",
    ]


def compose(overrides: Sequence[str], *, world_size: int | None = None) -> Any:
    """The composed, validated ``quickstart`` experiment with ``overrides``."""
    from longboat.core.config.compose import compose_experiment

    return compose_experiment("quickstart", list(overrides), stack="llm", world_size=world_size)


# The start of a script run by ``run_interpreted``: a one-rank gloo group, megatron's parallel
# state, and ``cfg`` = the tiny llama3 flavour (the body builds models from it).
_INTERPRETED_PREAMBLE = """\
import os, socket, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ["MASTER_PORT"] = str(s.getsockname()[1])
os.environ["MASTER_ADDR"] = "127.0.0.1"
dist.init_process_group("gloo", rank=0, world_size=1)
from longboat.core.config.schema import ParallelConfig
from longboat.core.device import get_accelerator
from longboat.core.megatron import parallel_state
from longboat.llm import build
from longboat.core.family import find_family
parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
cfg = find_family("llm", "llama3").flavor("tiny")
"""


def run_interpreted(
    body: str, script: Path, *args: str, timeout: float = 300
) -> dict[str, list[list[str]]]:
    """Run ``body`` (after a preamble that sets up megatron on one CPU rank and ``cfg``, the
    tiny llama3) as the file ``script`` in a fresh Python with every longboat kernel in
    Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before triton is imported, which
    a running test process cannot do. Returns the output lines that start with an upper-case
    tag (``RESULT ...``), split on white space, by tag; raises with the output's tail when the
    script fails."""
    import os
    import subprocess
    import sys

    script.write_text(_INTERPRETED_PREAMBLE + body + "\nparallel_state.destroy()\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "LONGBOAT_KERNELS_IMPL": "triton"}
    env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"{script.name} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    out: dict[str, list[list[str]]] = {}
    for line in done.stdout.splitlines():
        words = line.split()
        if words and words[0].isupper():
            out.setdefault(words[0], []).append(words[1:])
    return out


def make_hf_checkpoint(
    root: Path, family: str = "qwen3", *, records: int = 80
) -> tuple[Path, Path]:
    """(tiny HF checkpoint dir with its tokenizer, chat JSONL file): what a user fine-tunes."""
    import shutil

    from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

    chats = [
        [
            {"role": "user", "content": f"count from {i % 7} please"},
            {"role": "assistant", "content": " ".join(str((i % 7) + k) for k in range(4))},
        ]
        for i in range(records)
    ]
    root.mkdir(parents=True, exist_ok=True)
    jsonl = root / "chats.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    ckpt = make_hf_dir(family, root / f"{family}-tiny")
    texts = [m["content"] for c in chats for m in c]
    tok = Path(train_tiny_tokenizer(texts, root / "tokenizer", vocab_size=256))
    for f in tok.iterdir():
        shutil.copy(f, ckpt / f.name)
    return ckpt, jsonl


def make_hf_dir(family: str, out: Path, *, seed: int = 0) -> Path:
    """Save a randomly initialised tiny HF model of ``family`` to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from longboat.core.family import find_family

    fam = find_family("llm", family)
    hf_config = fam.to_hf_config(fam.flavor("tiny"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    # Random (not default-init) norm weights, so a swapped or skipped norm shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out


_CLI_SEQUENCE = """\
import json, sys
from longboat.llm.cli import main
for argv in json.loads(sys.argv[1]):
    print("\\n=== longboat-llm", json.dumps(argv), flush=True)
    code = main(argv)
    print(f"\\n=== exit {code}", flush=True)
    if code:
        sys.exit(code)
"""


def run_cli_commands(commands: Sequence[Sequence[str]], *, timeout: float = 300) -> list[str]:
    """Run ``longboat-llm`` ``commands`` one after another in ONE fresh Python on the CPU (what
    ``python -m longboat.llm.cli ARGV`` runs for each: ``main(ARGV)``), paying its imports
    once. Returns each command's stdout; raises with the output's tail when one exits
    non-zero."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "LONGBOAT_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    argvs = [list(map(str, c)) for c in commands]
    done = subprocess.run(
        [sys.executable, "-c", _CLI_SEQUENCE, json.dumps(argvs)], env=env,
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(
            f"longboat-llm exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    sections = done.stdout.split("\n=== longboat-llm ")[1:]
    assert len(sections) == len(argvs), done.stdout[-3000:]
    return [s.split("\n", 1)[1].rsplit("\n=== exit 0", 1)[0] for s in sections]

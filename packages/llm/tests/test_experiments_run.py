"""Every experiment ``longboat-llm config list`` offers composes and trains (a few steps of a
tiny model of its family, one CPU process: the recipes' own layouts are for 8 GPUs; the
quickstart runs whole in test_quickstart.py), and a model chosen on the command line replaces
the experiment's model settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from llm_testkit import make_hf_checkpoint

from longboat.core.config.compose import compose_experiment
from longboat.core.distributed import run_multiprocess
from longboat.llm.stack import STACK

ONE_PROCESS = [
    "parallel.tensor_parallel=1",
    "parallel.pipeline_parallel=1",
    "parallel.expert_parallel=1",
    "train.steps=2",
    "train.micro_batch_size=1",
    "train.global_batch_size=2",
    "train.eval_every=0",
    "checkpoint.every_steps=0",
    "logging.progress=false",
    "logging.trackers=[]",
    "export.enabled=false",
    "llm.generate_prompt=null",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("experiments")
    out = {}
    for family in ("llama3", "qwen3", "qwen3_moe", "deepseek_v3"):
        out[family], out["jsonl"] = make_hf_checkpoint(root / family, family)
    out["root"] = root
    out["pairs"] = _pairs_from_chats(out["jsonl"], root / "pairs.jsonl")
    return out


def _pairs_from_chats(chats: Path, out: Path) -> Path:
    """Preference pairs for the dpo recipe: each chat's answer chosen, its words reversed
    rejected."""
    import json

    rows = []
    for line in chats.read_text().splitlines():
        user, answer = (m["content"] for m in json.loads(line)["messages"])
        rows.append({"prompt": user, "chosen": answer,
                     "rejected": " ".join(reversed(answer.split()))})  # fmt: skip
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _overrides(name: str, files: dict[str, Path], out: Path) -> list[str]:
    family = next((f for f in ("qwen3_moe", "llama3", "qwen3") if name.startswith(f)), "qwen3")
    family = "deepseek_v3" if name.startswith("moonlight") else family
    extra = [f"output_dir={out}", *ONE_PROCESS]
    if name.endswith("_tiny"):  # random tokens
        return [*extra, "data.seq_len=64"]
    extra.append(f"data.cache_dir={files['root'] / 'cache'}")
    ckpt = files[family]
    if name.endswith("_pretrain"):  # from scratch: the tiny flavor, the checkpoint's tokenizer
        return [*extra, f"model={family}_tiny", f"data.paths=[{files['jsonl']}]",
                f"data.tokenizer={ckpt}", "data.seq_len=64"]  # fmt: skip
    data = files["pairs"] if name == "dpo" else files["jsonl"]  # dpo trains on pairs
    return [*extra, f"model.init_from={ckpt}", f"data.paths=[{data}]"]


def _run(rank: int, world: int, name: str, overrides: list[str]) -> list[float]:
    from longboat.llm.train.training import train

    return train(compose_experiment(name, overrides, stack="llm", world_size=world)).losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [e for e in STACK.experiments() if e != "quickstart"])
def test_every_listed_experiment_trains(name: str, files, tmp_path: Path) -> None:
    (losses,) = run_multiprocess(_run, 1, name, _overrides(name, files, tmp_path), timeout=300)
    assert len(losses) == 2 and all(loss == loss and loss < 50 for loss in losses), losses


def test_a_model_on_the_command_line_replaces_the_experiments_model() -> None:
    with pytest.warns(UserWarning, match=r"model=qwen3_0_6b replaces the model settings"):
        cfg = compose_experiment("quickstart", ["model=qwen3_0_6b"], stack="llm")
    assert (cfg.model.flavor, cfg.model.hidden_size, cfg.model.num_layers) == ("0.6b", 1024, 28)
    assert cfg.model.vocab_size == 151936
    # A model key on the command line still applies on top of the chosen option.
    cfg = compose_experiment("quickstart", ["model=qwen3_0_6b", "model.num_layers=2"], stack="llm")
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (1024, 2)
    # Without a model on the command line, the experiment's settings stand.
    cfg = compose_experiment("quickstart", [], stack="llm")
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (128, 4)

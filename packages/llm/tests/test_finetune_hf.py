"""Fine-tuning a Hugging Face checkpoint as a user does: the architecture from its
config.json, the user's raw JSONL tokenised on first use, an export that transformers loads,
generates from (stopping at EOS) and whose logits equal longboat's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from llm_testkit import make_hf_checkpoint, run_cli_commands

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess

TOL = 1e-4  # fp32 logits, longboat vs transformers (as test_hf_parity)


@pytest.fixture(scope="module")
def user_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finetune")
    qwen, jsonl = make_hf_checkpoint(root / "qwen", "qwen3")
    llama, _ = make_hf_checkpoint(root / "llama", "llama3")
    return {"qwen3": qwen, "llama3": llama, "jsonl": jsonl, "root": root}


def _compose(*overrides: str, experiment: str = "sft"):
    return compose_experiment(experiment, list(overrides), stack="llm", world_size=1)


def test_the_architecture_and_tokenizer_come_from_the_checkpoint(user_files) -> None:
    for family in ("qwen3", "llama3"):
        ckpt = user_files[family]
        hf = json.loads((ckpt / "config.json").read_text())
        # qwen3_sft's model group is Qwen3-8B on TP=2: the checkpoint's config.json wins.
        cfg = _compose(
            f"model.init_from={ckpt}",
            f"data.paths=[{user_files['jsonl']}]",
            "parallel.tensor_parallel=1",
            experiment="qwen3_sft",
        )
        assert cfg.model.name == family and cfg.model.flavor == "hf"
        assert cfg.model.hidden_size == hf["hidden_size"] == 64
        assert cfg.model.num_layers == hf["num_hidden_layers"]
        assert cfg.model.vocab_size == hf["vocab_size"]
        assert cfg.model.tie_embeddings == hf["tie_word_embeddings"]
        assert cfg.data.tokenizer == str(ckpt)  # the checkpoint ships its tokenizer
        assert cfg.data.seq_len == hf["max_position_embeddings"]  # 4096 cut to what it covers


def test_overrides_are_checked_against_the_checkpoint(user_files) -> None:
    ckpt = user_files["llama3"]
    base = [f"model.init_from={ckpt}", f"data.paths=[{user_files['jsonl']}]"]
    with pytest.raises(ConfigError) as err:
        _compose(*base, "model.hidden_size=128")
    assert err.value.keys == ["model.hidden_size"]
    assert "conflicts with" in str(err.value) and "(hidden_size=64)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        _compose(*base, "model=qwen3_tiny")  # another family: every differing field named
    assert "model.name" in err.value.keys and "drop model=<option>" in str(err.value)
    # Keys the weights do not fix may change.
    cfg = _compose(*base, "model.layer_backend=local", "model.max_position_embeddings=128")
    assert cfg.model.layer_backend == "local" and cfg.model.max_position_embeddings == 128


def test_the_export_may_not_overwrite_the_checkpoint_it_starts_from(user_files) -> None:
    from omegaconf import OmegaConf

    from longboat.llm.train.checks import check_run

    ckpt = user_files["qwen3"]
    base = [f"model.init_from={ckpt}", f"data.paths=[{user_files['jsonl']}]"]
    cfg = OmegaConf.to_object(_compose(*base, f"export.dir={ckpt}/."))
    with pytest.raises(ConfigError) as err:
        check_run(cfg, cfg.model)
    assert err.value.keys == ["export.dir"] and "overwrite" in str(err.value)
    check_run(OmegaConf.to_object(_compose(*base)), cfg.model)  # <output_dir>/hf is fine


def test_a_checkpoint_of_an_unknown_family_is_named(user_files, tmp_path: Path) -> None:
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["X"]}))
    with pytest.raises(ConfigError) as err:
        _compose(f"model.init_from={bad}", f"data.paths=[{user_files['jsonl']}]")
    assert err.value.keys == ["model.init_from"] and "gpt2" in str(err.value)


def test_raw_files_are_prepared_once_and_reused(user_files, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from longboat.llm.data.indexed import IndexedTokenDataset
    from longboat.llm.data.raw import prepared_path

    tok, jsonl, cache = user_files["qwen3"], user_files["jsonl"], tmp_path / "cache"
    logs: list[str] = []
    first = prepared_path(jsonl, tok, cache_dir=cache, log=logs.append, progress=False)
    assert any("Preparing" in line for line in logs) and "sft" in first.name
    built = (first / "manifest.json").stat().st_mtime_ns
    logs.clear()
    assert prepared_path(jsonl, tok, cache_dir=cache, log=logs.append) == first and not logs
    assert (first / "manifest.json").stat().st_mtime_ns == built  # reused, not rebuilt
    ds = IndexedTokenDataset(first)
    assert ds.num_docs == 80 and ds.manifest["kind"] == "sft"
    # The same records as Parquet and as plain text: other content, other cache entries.
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    text = tmp_path / "notes.jsonl"
    text.write_text("".join(json.dumps({"text": f"boat {i} sails"}) + "\n" for i in range(30)))
    pretrain = prepared_path(text, tok, cache_dir=cache, progress=False, log=lambda *_: None)
    assert "pretrain" in pretrain.name and IndexedTokenDataset(pretrain).num_docs == 30
    parquet = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    other = prepared_path(parquet, tok, cache_dir=cache, progress=False, log=lambda *_: None)
    assert other != first and IndexedTokenDataset(other).num_docs == 80
    jsonl_copy = tmp_path / "chats.jsonl"
    jsonl_copy.write_text(jsonl.read_text() + json.dumps({"messages": records[0]["messages"]}))
    changed = prepared_path(jsonl_copy, tok, cache_dir=cache, progress=False, log=lambda *_: None)
    assert changed != first and IndexedTokenDataset(changed).num_docs == 81


def _finetune_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from longboat.llm.train.training import train

    cfg = compose_experiment("sft", overrides, stack="llm", world_size=world)
    result = train(cfg)
    return {
        "losses": result.losses,
        "export": str(result.export_dir),
        "ckpt": str(result.checkpoint),
        "extra": dict(result.extra),
    }


def _longboat_logits(rank: int, world: int, hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from pipeline_testkit import forward_logits

    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.llm.build import build_model
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=1)
    try:
        chunks = build_model(cfg)
        load_hf(chunks, cfg, hf_dir)
        return forward_logits(chunks, tokens)
    finally:
        parallel_state.destroy()


def _convert_worker(rank: int, world: int, ckpt: str, out: Path) -> Path:
    from longboat.llm.convert import native_to_hf

    return native_to_hf(ckpt, out)


@pytest.mark.multiprocess
def test_one_command_fine_tunes_and_the_export_generates_correctly(user_files) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = user_files["root"] / "run"
    overrides = [
        f"model.init_from={user_files['qwen3']}",
        f"data.paths=[{user_files['jsonl']}]",
        f"data.cache_dir={user_files['root'] / 'cache'}",
        f"output_dir={out}",
        "train.steps=3",
        "train.global_batch_size=2",
        "optim.lr=1e-3",
        "logging.progress=false",
        "logging.trackers=[]",
        "llm.generate_prompt=count from 3 please",
        "llm.generate_tokens=6",
    ]
    (res,) = run_multiprocess(_finetune_worker, 1, overrides, timeout=300)
    assert len(res["losses"]) == 3 and all(torch.isfinite(torch.tensor(res["losses"])))
    export = Path(res["export"])
    assert sorted(p.name for p in export.glob("model*.safetensors*")) == ["model.safetensors"]
    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert tok.eos_token_id is not None
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    prompt = tok("count from 3 please", return_tensors="pt")
    # EOS made the likeliest token from the first step: generate() must stop right there.
    stopped = model.generate(
        **prompt, max_new_tokens=12, do_sample=False, sequence_bias={(tok.eos_token_id,): 100.0}
    )
    assert stopped.shape[1] == prompt["input_ids"].shape[1] + 1
    assert stopped[0, -1].item() == tok.eos_token_id
    # The post-run sample of a chat run asked the prompt as a user turn: its answer is what
    # the export answers to the chat template's rendering, new tokens only.
    asked = tok.apply_chat_template(
        [{"role": "user", "content": "count from 3 please"}], tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    ids = tok(asked, return_tensors="pt", add_special_tokens=False)["input_ids"]
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                          do_sample=False)[0, ids.shape[1] :]  # fmt: skip
    assert res["extra"]["generation_chat"] is True
    assert res["extra"]["generation"] == tok.decode(want, skip_special_tokens=True).strip()
    # The export's logits are longboat's (the trained weights, read back by longboat).
    tokens = torch.randint(
        0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        theirs = model(tokens).logits
    (ours,) = run_multiprocess(_longboat_logits, 1, str(export), tokens)
    assert (ours - theirs).abs().max().item() <= TOL
    # The native checkpoint converts to the same export, tokenizer and special tokens included
    # (in a worker: megatron's parallel state must not be set up in this, the forking, process).
    (again,) = run_multiprocess(_convert_worker, 1, res["ckpt"], user_files["root"] / "converted")
    assert (again / "tokenizer.json").is_file()
    cfg = json.loads((again / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.eos_token_id
    assert json.loads((again / "generation_config.json").read_text())["eos_token_id"] == (
        tok.eos_token_id
    )


def test_the_readmes_first_example_runs_as_written(user_files, tmp_path: Path) -> None:
    """The first command of the llm README, on the tiny checkpoint and chats this test made
    (its paths swapped in; fewer steps and a scratch run directory)."""
    import re
    import shlex

    readme = Path(__file__).parents[1] / "README.md"
    block = re.search(r"```bash\n(longboat-llm train [^\n]+)\n```", readme.read_text())
    assert block, "the README's first example is a longboat-llm train command"
    argv = shlex.split(block.group(1))
    assert "experiment=sft" in argv and any(a.startswith("data.paths=") for a in argv)
    argv = [
        f"model.init_from={user_files['qwen3']}" if a.startswith("model.init_from=")
        else f"data.paths=[{user_files['jsonl']}]" if a.startswith("data.paths=")
        else "train.steps=2" if a.startswith("train.steps=") else a
        for a in argv[1:]
    ]  # fmt: skip
    argv += [f"output_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}",
             "train.global_batch_size=2", "logging.progress=false"]  # fmt: skip
    # The section's `longboat-llm generate` commands, on this run's export and checkpoints:
    # the same weights, the same answers. All three commands in one process (imports once).
    section = readme.read_text().split("## Install")[0]
    generate = [shlex.split(line.split("#")[0])
                for line in re.findall(r"^longboat-llm generate [^\n]+", section, flags=re.M)]  # fmt: skip
    assert len(generate) == 2, "an export and a native checkpoint"
    files = [tmp_path / f"answers{i}.jsonl" for i in range(len(generate))]
    commands = [argv] + [
        [*(a.replace("outputs/sft", str(tmp_path)) for a in command[1:]), "--output", file]
        for command, file in zip(generate, files)
    ]
    stdout = run_cli_commands(commands)[0]
    assert "Trained steps 1..2" in stdout
    assert stdout.startswith("Building the run (sft, data=prepared)")
    # A short run says how much of the data it sees and that it is mostly warm-up.
    assert re.search(r"Run: 2 steps x 2 rows = 0\.\d\d passes over the \d+ training rows; LR "
                     r"peaks at 2e-05 after 10 warm-up steps\. Half the run or more is LR "
                     r"warm-up", " ".join(stdout.split())), stdout  # fmt: skip
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert (tmp_path / "hf" / "generation_config.json").is_file()

    # The export generates and stops at EOS (made the likeliest token from the first step).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = tok("count from 3 please", return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                         do_sample=False, sequence_bias={(tok.eos_token_id,): 100.0})  # fmt: skip
    assert out[0, ids.shape[1] :].tolist() == [tok.eos_token_id]

    answers = [json.loads(file.read_text()) for file in files]
    assert answers[0] == answers[1] and answers[0]["prompt"] == "Say hi."

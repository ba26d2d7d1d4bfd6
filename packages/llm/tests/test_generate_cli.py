"""``longboat-llm generate``: prompts answered through the chat template by an export or a
native checkpoint, greedily, as ``transformers`` answers them (CPU, a tiny checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from llm_testkit import make_hf_checkpoint, run_cli_commands

PROMPTS = ["count from 3 please", "count from 5 please"]


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from longboat.llm.train.export import write_generation_files

    ckpt, _ = make_hf_checkpoint(tmp_path_factory.mktemp("gen"), "qwen3")
    write_generation_files(ckpt, ckpt, None)  # as a run's export: eos / pad ids written
    return ckpt


def _reference(export: Path, prompt: str, tokens: int, chat: bool = True) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": prompt}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text if chat else prompt
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                         do_sample=False)  # fmt: skip
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_prompts_from_the_command_line_and_files(export: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from longboat.llm.cli import main

    want = [_reference(export, p, 8) for p in PROMPTS]
    out = tmp_path / "answers.jsonl"
    argv = ["generate", str(export), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]
    assert main([*argv, "--max-new-tokens", "8", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, want)]
    assert f"### {PROMPTS[0]}\n{want[0]}\n" in capsys.readouterr().out
    txt = tmp_path / "prompts.txt"
    txt.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    for file in (txt, jsonl):
        assert main(["generate", str(export), "--prompts", str(file), "--max-new-tokens", "8",
                     "--output", str(out)]) == 0  # fmt: skip
        assert [json.loads(line)["answer"] for line in out.read_text().splitlines()] == want
    raw = _reference(export, PROMPTS[0], 8, chat=False)
    assert main([*argv[:4], "--raw", "--max-new-tokens", "8", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["answer"] == raw


def test_bad_input_is_one_line_and_exit_2(export: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from longboat.llm.cli import main

    assert main(["generate", str(export)]) == 2
    assert "no prompt: pass --prompt TEXT or --prompts FILE" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "hi"}\n')
    assert main(["generate", str(export), "--prompts", str(bad)]) == 2
    assert f"{bad}:1: a record needs a 'prompt' (or 'text') string" in capsys.readouterr().err


def test_a_native_checkpoint_answers_as_its_export(export: Path, tmp_path: Path) -> None:
    """``convert hf-to-native`` then ``generate`` on the native checkpoint (one process)."""
    native, out = tmp_path / "native", tmp_path / "answers.jsonl"
    run_cli_commands([
        ["convert", "hf-to-native", export, native],
        ["generate", native, "--tokenizer", export, "--prompt", PROMPTS[0],
         "--max-new-tokens", "8", "--output", out],
    ])  # fmt: skip
    assert json.loads(out.read_text())["answer"] == _reference(export, PROMPTS[0], 8)

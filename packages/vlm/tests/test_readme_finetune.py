"""The README's "Fine-tune a Hugging Face checkpoint" section, run as written (its paths
swapped for a tiny local checkpoint and a generated shapes set, two steps, a scratch run
directory): the run exports a directory whose ``generate()`` stops at ``<|im_end|>``, and
the section's ``longboat-vlm generate`` commands answer from it.

The checkpoint predicts ``<|im_end|>`` first for any input (``eos_first``), so an export that
stops answers with nothing after one token, where one without its stop ids runs on.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import torch
from vlm_testkit import make_qwen2_5_vl_checkpoint, run_cli_commands

README = Path(__file__).parents[1] / "README.md"


def _section() -> str:
    text = README.read_text()
    start = text.index("## Fine-tune a Hugging Face checkpoint")
    return text[start : text.index("\n## ", start + 1)]


def _commands(section: str) -> list[list[str]]:
    """Each command of the section's bash blocks (continuation lines joined, comments cut)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                out.append(shlex.split(line.split("#")[0]))
    return out


def test_the_readmes_fine_tune_section_runs_as_written(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from longboat.vlm.data.shapes_dataset import make_shapes_dataset

    ckpt = make_qwen2_5_vl_checkpoint(tmp_path / "ckpt", eos_first=True)
    shapes = make_shapes_dataset(tmp_path / "shapes", 12, seed=0, size=64)
    commands = _commands(_section())
    train, generate = commands[0], commands[1:]
    assert train[:3] == ["longboat-vlm", "train", "experiment=sft"]
    swap = {
        "model.init_from": f"model.init_from={ckpt}",
        "data.paths": f"data.paths=[{shapes.train}]",
        "data.root": f"data.root={shapes.train.parent}",
    }
    argv = [swap.get(a.split("=")[0], a) for a in train[1:]]
    assert sorted(a.split("=")[0] for a in argv if a.split("=")[0] in swap) == sorted(swap)
    run = tmp_path / "run"
    argv += [f"output_dir={run}", "train.steps=2", "train.global_batch_size=2",
             "data.seq_len=512", "logging.progress=false", "logging.trackers=[]"]  # fmt: skip
    export = run / "hf"
    image = shapes.train.parent / "images" / "00001.png"
    asks = tmp_path / "asks.jsonl"
    asks.write_text(json.dumps({"prompt": "What colour is it?", "image": str(image)}) + "\n")
    # The training command and the section's generate commands in one process (imports once).
    files, commands = [], [argv]
    for i, command in enumerate(generate):
        assert command[:2] == ["longboat-vlm", "generate"]
        files.append(tmp_path / f"answers{i}.jsonl")
        commands.append([
            str(export) if a.endswith("/hf") else str(image) if a.endswith(".jpg")
            else str(asks) if a.endswith(".jsonl") else a
            for a in command[1:]
        ] + ["--output", str(files[-1])])  # fmt: skip
    run_cli_commands(commands, cwd=tmp_path)
    assert (export / "generation_config.json").is_file()

    tok = AutoTokenizer.from_pretrained(str(export))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForImageTextToText.from_pretrained(str(export)).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What colour is it?"}],
                                   tokenize=False, add_generation_prompt=True)  # fmt: skip
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False)  # fmt: skip
    assert out[0, ids.shape[1] :].tolist() == [end], "generate() stops at <|im_end|>"

    for answers in files:
        rows = [json.loads(line) for line in answers.read_text().splitlines()]
        assert [r["answer"] for r in rows] == [""], rows  # <|im_end|> first, nothing after

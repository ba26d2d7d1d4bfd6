"""``longboat-vlm generate`` from a native checkpoint (CPU, tiny Qwen2.5-VL fine-tunes).

A two-step fine-tune of a tiny random checkpoint writes a native checkpoint and its export:
the checkpoint converted (``longboat.vlm.convert.native_to_hf``) is the export file for file
(weights bit for bit), and ``generate`` from the checkpoint answers what it answers from
the export. A fine-tune of a checkpoint that predicts ``<|im_end|>`` first answers nothing
from its native checkpoint: generation stops at the end of the turn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vlm_testkit import make_qwen2_5_vl_checkpoint

# Slow: two fine-tunes (minutes on CPU), and after this module's in-process generation the
# test process cannot fork multiprocess workers for later modules (they hang).
pytestmark = pytest.mark.slow

QUESTIONS = [("What colour is the shape?", "00001.png"), ("Where is it?", "00002.png")]


def _train(overrides: list[str], cwd: Path) -> None:
    """``longboat-vlm train experiment=sft <overrides>`` in a fresh process (no fork of this
    one, whose OpenMP pool has run)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LONGBOAT_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    argv = [sys.executable, "-m", "longboat.vlm.cli", "train", "experiment=sft", *overrides]
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _fine_tune(root: Path, *, eos_first: bool) -> dict[str, Path]:
    from longboat.vlm.data.shapes_dataset import make_shapes_dataset

    ckpt = make_qwen2_5_vl_checkpoint(root / "ckpt", eos_first=eos_first, seed=3)
    shapes = make_shapes_dataset(root / "shapes", 12, seed=0, size=64)
    run = root / "run"
    overrides = [
        f"model.init_from={ckpt}",
        f"data.paths=[{shapes.train}]",
        f"data.root={shapes.train.parent}",
        f"output_dir={run}",
        "train.steps=2",
        "train.global_batch_size=2",
        "data.seq_len=512",
        "logging.progress=false",
        "logging.trackers=[]",
        "vlm.answer_eval_samples=0",
    ]
    _train(overrides, root)
    return {"export": run / "hf", "checkpoints": run / "checkpoints", "shapes": shapes.train}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _fine_tune(tmp_path_factory.mktemp("vlm_native"), eos_first=False)


def _ask(model: Path, asks: Path, out: Path) -> list[str]:
    from longboat.vlm.cli import main

    argv = ["generate", str(model), "--prompts", str(asks), "--max-new-tokens", "8"]
    assert main([*argv, "--output", str(out)]) == 0
    return [json.loads(line)["answer"] for line in out.read_text().splitlines()]


def _asks(tmp_path: Path, shapes: Path) -> Path:
    images = shapes.parent / "images"
    asks = tmp_path / "asks.jsonl"
    asks.write_text("".join(json.dumps({"prompt": q, "image": str(images / name)}) + "\n"
                            for q, name in QUESTIONS))  # fmt: skip
    return asks


def test_the_converted_checkpoint_is_the_export(tuned: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from longboat.vlm.convert import native_to_hf

    export = tuned["export"]
    got = native_to_hf(tuned["checkpoints"], tmp_path / "hf")
    names = sorted(p.name for p in export.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    for name in names:
        if name.endswith(".safetensors"):
            want, have = load_file(export / name), load_file(got / name)
            assert sorted(have) == sorted(want)
            for key, tensor in want.items():
                assert have[key].dtype == tensor.dtype and torch.equal(have[key], tensor), key
        elif name.endswith(".json"):
            assert json.loads((got / name).read_text()) == json.loads(
                (export / name).read_text()
            ), name
        else:
            assert (got / name).read_bytes() == (export / name).read_bytes(), name


def test_generate_from_the_checkpoint_answers_as_the_export(
    tuned: dict[str, Path], tmp_path: Path
) -> None:
    asks = _asks(tmp_path, tuned["shapes"])
    want = _ask(tuned["export"], asks, tmp_path / "export.jsonl")
    assert any(want), "a model whose answers are all empty compares nothing"
    step = sorted(tuned["checkpoints"].glob("step_*"))[-1]
    assert _ask(step, asks, tmp_path / "step.jsonl") == want  # a step folder
    assert _ask(tuned["checkpoints"], asks, tmp_path / "root.jsonl") == want  # checkpoint.dir


def test_generate_from_the_checkpoint_stops_at_the_end_of_the_turn(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from longboat.vlm.convert import native_to_hf

    run = _fine_tune(tmp_path / "eos", eos_first=True)
    asks = _asks(tmp_path, run["shapes"])
    assert _ask(run["checkpoints"], asks, tmp_path / "answers.jsonl") == ["", ""]
    hf = native_to_hf(run["checkpoints"], tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(str(hf))
    model = AutoModelForImageTextToText.from_pretrained(str(hf)).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What colour is it?"}],
                                   tokenize=False, add_generation_prompt=True)  # fmt: skip
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False)  # fmt: skip
    assert out[0, ids.shape[1] :].tolist() == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_a_path_that_is_no_checkpoint_is_one_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from longboat.vlm.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["generate", str(empty), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no finished native checkpoint" in err and str(empty) in err
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err

"""A VLM export holds the ids ``generate()`` stops and pads with (CPU, tiny random weights).

The model of ``make_qwen2_5_vl_checkpoint(eos_first=True)`` predicts EOS first for any
prompt: without ``eos_token_id`` in the export's config it generates EOS up to
``max_new_tokens``; with the ids the export writes it stops after one token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from vlm_testkit import make_qwen2_5_vl_checkpoint


def _generate(path: Path) -> list[int]:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What colour is the shape?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             do_sample=False)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_the_export_stops_at_the_end_of_the_turn(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from longboat.vlm.train.export import write_generation_config

    ckpt = make_qwen2_5_vl_checkpoint(tmp_path / "ckpt", eos_first=True)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert _generate(ckpt) == [eos] * 6, "without the ids generate() runs on past EOS"

    export = tmp_path / "export"
    shutil.copytree(ckpt, export)
    ids = write_generation_config(export, tok)
    assert ids == {"eos_token_id": eos, "pad_token_id": pad}
    config = json.loads((export / "config.json").read_text())
    assert config["text_config"]["eos_token_id"] == config["eos_token_id"] == eos
    assert config["text_config"]["pad_token_id"] == pad
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eos and generation["pad_token_id"] == pad
    assert _generate(export) == [eos]


def test_the_source_checkpoints_generation_config_wins(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    from longboat.vlm.train.export import write_generation_config

    ckpt = make_qwen2_5_vl_checkpoint(tmp_path / "ckpt")
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, temperature=0.1,
                     do_sample=True).save_pretrained(str(ckpt))  # fmt: skip
    export = tmp_path / "export"
    shutil.copytree(ckpt, export)
    (export / "generation_config.json").unlink()
    write_generation_config(export, tok, ckpt)
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [eos, pad]
    assert generation["temperature"] == 0.1 and generation["do_sample"] is True
    assert json.loads((export / "config.json").read_text())["eos_token_id"] == [eos, pad]

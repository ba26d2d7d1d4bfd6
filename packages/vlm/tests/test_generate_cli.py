"""``longboat-vlm generate``: questions about images answered by a run's export through the
chat template, with images processed as in training (CPU, a tiny random Qwen2.5-VL).

The reference is built with longboat's own processing (the training data's pixels, vision
token expansion and M-RoPE token types): the command's inputs equal it bit for bit, and its
answers equal ``transformers``' ``generate`` on it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from vlm_testkit import make_qwen2_5_vl_checkpoint

TOKENS = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoTokenizer

    from longboat.vlm.data.shapes_dataset import make_shapes_dataset
    from longboat.vlm.train.export import write_generation_config

    root = tmp_path_factory.mktemp("vlm_generate")
    ckpt = make_qwen2_5_vl_checkpoint(root / "export", seed=3)
    write_generation_config(ckpt, AutoTokenizer.from_pretrained(str(ckpt)))
    shapes = make_shapes_dataset(root / "shapes", 4, seed=0, size=96)
    return {"export": ckpt, "images": shapes.train.parent / "images"}


def _reference(export: Path, question: str, image: Path) -> tuple[str, dict]:
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from longboat.vlm.data.encoding import SampleEncoder, _expand
    from longboat.vlm.data.processor import QwenVisionProcessor, VisionProcessorConfig
    from longboat.vlm.models.mrope import token_types

    cfg = json.loads((export / "config.json").read_text())
    pcfg = VisionProcessorConfig.from_hf(
        json.loads((export / "preprocessor_config.json").read_text())
    )
    processor, tok = QwenVisionProcessor(pcfg), AutoTokenizer.from_pretrained(str(export))
    markup = SampleEncoder(tok, processor).tokens.markup("image")
    text = tok.apply_chat_template([{"role": "user", "content": markup + question}],
                                   tokenize=False, add_generation_prompt=True)  # fmt: skip
    ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    pixels = processor.preprocess_images([Image.open(image).convert("RGB")])
    merged = int(pixels["image_grid_thw"].prod()) // pcfg.merge_size**2
    ids, _ = _expand(ids, np.zeros_like(ids, dtype=np.uint8), cfg["image_token_id"], [merged],
                     "image", "test")  # fmt: skip
    input_ids = torch.from_numpy(ids)[None]
    model = AutoModelForImageTextToText.from_pretrained(str(export)).eval()
    types = token_types(input_ids, cfg["image_token_id"], cfg["video_token_id"]).int()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             mm_token_type_ids=types, pixel_values=pixels["pixel_values"],
                             image_grid_thw=pixels["image_grid_thw"], max_new_tokens=TOKENS,
                             do_sample=False)  # fmt: skip
    answer = tok.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True).strip()
    return answer, {"input_ids": input_ids, **pixels}


def test_answers_equal_longboats_processing_through_transformers(files, tmp_path) -> None:
    from longboat.vlm.cli import main

    export, images = files["export"], files["images"]
    questions = [("What colour is the shape?", "00001.png"), ("Where is it?", "00002.png")]
    refs = [_reference(export, q, images / name) for q, name in questions]
    want = [answer for answer, _ in refs]
    # The command's inputs are the training pipeline's, bit for bit.
    from longboat.vlm.generate import VisionChatGenerator

    gen = VisionChatGenerator(export)
    for (q, name), (_, ref) in zip(questions, refs):
        got = gen.inputs(q, [images / name])
        for key in ("input_ids", "pixel_values", "image_grid_thw"):
            assert torch.equal(got[key], ref[key]), key
    prompts = tmp_path / "asks.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q, "image": f"img/{name}"}) + "\n"
                               for q, name in questions))  # fmt: skip
    (tmp_path / "img").symlink_to(images)
    out = tmp_path / "answers.jsonl"
    argv = ["generate", str(export), "--prompts", str(prompts), "--output", str(out)]
    assert main([*argv, "--max-new-tokens", str(TOKENS)]) == 0
    assert [json.loads(line)["answer"] for line in out.read_text().splitlines()] == want
    # One question on the command line, its image placed by an <image> placeholder.
    one = ["generate", str(export), "--prompt", f"<image>{questions[0][0]}", "--image",
           str(images / "00001.png"), "--max-new-tokens", str(TOKENS), "--output", str(out)]  # fmt: skip
    assert main(one) == 0 and json.loads(out.read_text())["answer"] == want[0]


def test_bad_input_is_one_line_and_exit_2(files, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from longboat.vlm.cli import main

    export = files["export"]
    assert main(["generate", str(export)]) == 2
    assert "no prompt" in capsys.readouterr().err
    missing = tmp_path / "nope.png"
    assert main(["generate", str(export), "--prompt", "hi", "--image", str(missing)]) == 2
    assert f"image {missing} does not exist" in capsys.readouterr().err
    assert main(["generate", str(export), "--prompt", "<image><image>hi", "--image",
                 str(files["images"] / "00001.png")]) == 2  # fmt: skip
    assert "2 <image> placeholder(s) for 1 image(s)" in capsys.readouterr().err

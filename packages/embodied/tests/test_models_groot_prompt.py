"""GR00T N1.6's prompt with a Hugging Face tokenizer (``model.tokenizer``): ids and masks equal
Isaac-GR00T N1.6's way of building them (its processor's task formatting, the Eagle chat
template rendered by the tokenizer's own ``apply_chat_template``, the Eagle processor's
image-placeholder expansion, one left-padded tokenizer call) on a tiny Qwen-style tokenizer
built here; the tokenizer checked against the model before it is built; where a run's
tokenizer comes from; a tiny run that trains with it and exports it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from embodied_testkit import write_tiny_qwen_tokenizer

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.train.trainer import typed_config
from longboat.embodied.models import build_model, get_config
from longboat.embodied.models.groot_n1_6.isaac_format import isaac_config_for, save_isaac_groot
from longboat.embodied.models.groot_n1_6.processor import GrootPromptTokenizer
from longboat.embodied.train.policy_batch import PolicyCollator, batch_spec
from longboat.embodied.train.reference_formats import prompt_tokenizer, run_tokenizer
from longboat.embodied.train.trainer import train

CAMS = ["observation.images.front", "observation.images.wrist"]
TASKS = [
    "Pick up the RED cube, then place it in the bowl!",
    "  stack_the green block (carefully)\non the box.  ",
    "fold the towel",
]
# Isaac-GR00T's conversation rendered by a chat template that re-states the Eagle
# processor's: a default system turn, then each turn's parts, images as <image-k> markers.
EAGLE_STYLE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% set seen = namespace(images=0) %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "{% set seen.images = seen.images + 1 %}<image-{{ seen.images }}>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen_tokenizer(tmp_path_factory.mktemp("qwen"))


def reference_tokens(path: Path, tasks: list[str], tokens_per_image: int):
    """Isaac-GR00T N1.6's steps, re-stated: lower case without punctuation, a one-turn chat
    (the text, then one image per camera) through the chat template, each <image-k> made
    '<image k><img>' + one <IMG_CONTEXT> per image token + '</img>', then one tokenizer
    call padded on the left to the longest."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    texts = []
    for task in tasks:
        language = "".join(c for c in task.lower() if c.isalnum() or c == "_" or c.isspace())
        chat = [
            {
                "role": "user",
                "content": [{"type": "text", "text": language}]
                + [{"type": "image", "image": None} for _ in CAMS],
            }
        ]
        text = tok.apply_chat_template(chat, chat_template=EAGLE_STYLE_TEMPLATE, tokenize=False)
        texts.append(
            re.sub(
                r"<image-(\d+)>",
                lambda m: f"<image {m.group(1)}><img>{'<IMG_CONTEXT>' * tokens_per_image}</img>",
                text,
            )
        )
    out = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    return texts, out["input_ids"], out["attention_mask"].bool()


def _samples(h: int = 56, w: int = 84) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "observation.state": torch.rand(6, generator=gen) * 2 - 1,
            "action": torch.zeros(10, 5),
            "task": task,
            **{cam: torch.rand(3, h, w, generator=gen) for cam in CAMS},
        }
        for task in TASKS
    ]


def _collate(tokenizer_dir: Path, **kwargs):
    cfg = get_config("groot_n1_6", "tiny", {"image_tokens_in_text": True})
    spec = batch_spec("groot_n1_6", cfg, len(CAMS), (56, 84))
    prompts = GrootPromptTokenizer(tokenizer_dir, cfg)
    return cfg, PolicyCollator(spec, CAMS, prompts=prompts, **kwargs)


def test_collator_ids_and_mask_equal_isaac_groot_prompts(tokenizer_dir: Path) -> None:
    cfg, collate = _collate(tokenizer_dir)
    batch = collate(_samples())
    tokens = cfg.tokens_per_image(56, 84)
    assert tokens == 6  # 56x84 -> crop 53x79 -> 56x83 -> Eagle's 56x84: 2x3 tokens
    texts, ids, mask = reference_tokens(tokenizer_dir, TASKS, tokens)
    ctx = "<IMG_CONTEXT>" * 6
    assert texts[0] == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"pick up the red cube then place it in the bowl<image 1><img>{ctx}</img>"
        f"<image 2><img>{ctx}</img><|im_end|>\n"
    )
    assert "  stack_the green block carefully\non the box  <image 1>" in texts[1]
    assert torch.equal(batch["input_ids"], ids)
    assert torch.equal(batch["attention_mask"], mask)
    # Left padding with <|endoftext|>; every row holds both cameras' placeholders.
    assert not mask[2, 0] and mask[:, -1].all()
    assert set(batch["input_ids"][2][~mask[2]].tolist()) == {320}  # <|endoftext|>
    assert ((batch["input_ids"] == cfg.image_token_id) & mask).sum(1).tolist() == [12] * 3
    # The model takes the batch: the placeholders are where the camera embeddings go.
    model = build_model("groot_n1_6", cfg)
    out = model({**batch, "embodiment_id": torch.zeros(3, dtype=torch.int64)})
    assert torch.isfinite(out["loss"])


def test_left_padding_leaves_a_samples_features_unchanged(tokenizer_dir: Path) -> None:
    """A short prompt's backbone features are the same alone and left-padded beside a long
    one (positions count valid tokens only)."""
    cfg, collate = _collate(tokenizer_dir)
    torch.manual_seed(0)
    model = build_model("groot_n1_6", cfg).eval()
    samples = _samples()
    both = collate([samples[2], samples[1]])
    alone = collate([samples[2]])
    pad = both["input_ids"].shape[1] - alone["input_ids"].shape[1]
    assert pad > 0
    with torch.no_grad():
        feats, valid, _ = model.backbone(both)
        ref, _, _ = model.backbone(alone)
    assert valid[0, :pad].logical_not().all()
    torch.testing.assert_close(feats[0, pad:], ref[0], rtol=0, atol=1e-5)


def test_fixed_length_prompts_for_a_graphed_step(tokenizer_dir: Path) -> None:
    _, collate = _collate(tokenizer_dir, fixed_text_length=True)
    batch = collate(_samples())
    length = GrootPromptTokenizer.fixed_length_for(2, 6)
    assert batch["input_ids"].shape == (3, length)
    _, ids, mask = reference_tokens(tokenizer_dir, TASKS, 6)
    assert torch.equal(batch["input_ids"][:, -ids.shape[1] :], ids)  # more left padding
    assert batch["attention_mask"].sum() == mask.sum()
    long = _samples()[:1]
    long[0]["task"] = "stack the box " * 80
    with pytest.raises(ValueError, match="does not fit the fixed length"):
        collate(long)


def test_tokenizer_is_checked_against_the_model(tmp_path: Path) -> None:
    """Before the model is built: Eagle's image tokens, the model's image token id and the
    vocabulary, each a ConfigError naming model.tokenizer."""
    cfg = get_config("groot_n1_6", "tiny", {})
    plain = write_tiny_qwen_tokenizer(tmp_path / "plain", image_tokens=False)
    with pytest.raises(ConfigError, match=re.escape("model.tokenizer")) as err:
        prompt_tokenizer(plain, "groot_n1_6", cfg)
    assert "<img> is not one token" in str(err.value)
    assert "<IMG_CONTEXT> is not one token" in str(err.value)
    shifted = write_tiny_qwen_tokenizer(tmp_path / "shifted", image_token_id=500)
    with pytest.raises(ConfigError, match="<IMG_CONTEXT> is id 500, the model's image token"):
        prompt_tokenizer(shifted, "groot_n1_6", cfg)
    big = write_tiny_qwen_tokenizer(tmp_path / "big", image_token_id=600)
    with pytest.raises(ConfigError, match="601 ids, more than the model's vocabulary of 512"):
        prompt_tokenizer(big, "groot_n1_6", get_config("groot_n1_6", "tiny", {}))


def _run_cfg(tmp_path: Path, *overrides: str):
    cfg = compose_experiment(
        "groot_n1_6_tiny", [f"output_dir={tmp_path / 'run'}", *overrides], world_size=1
    )
    return typed_config(cfg)


def test_where_the_tokenizer_of_a_run_comes_from(tmp_path: Path, tokenizer_dir: Path) -> None:
    # The released backbone without a tokenizer: one error naming the key.
    release = tmp_path / "release"
    release.mkdir()
    (release / "config.json").write_text(
        json.dumps({"model_type": "Gr00tN1d6", "model_name": "nvidia/Eagle-Block2A-2B-v2"})
    )
    with pytest.raises(ConfigError, match=re.escape("model.tokenizer")) as err:
        run_tokenizer(_run_cfg(tmp_path, f"model.init_from={release}"))
    assert "nvidia/Eagle-Block2A-2B-v2 tokenizer" in str(err.value)
    given = _run_cfg(tmp_path, f"model.init_from={release}", f"model.tokenizer={tokenizer_dir}")
    assert run_tokenizer(given) == tokenizer_dir
    # A tiny checkpoint (trained on the stand-in's ids) needs none; one beside it is found.
    model = build_model("groot_n1_6", "tiny")
    tiny = save_isaac_groot(model, tmp_path / "tiny", isaac_config_for(model))
    assert run_tokenizer(_run_cfg(tmp_path, f"model.init_from={tiny}")) is None
    write_tiny_qwen_tokenizer(tiny / "tokenizer")
    assert run_tokenizer(_run_cfg(tmp_path, f"model.init_from={tiny}")) == tiny / "tokenizer"
    assert run_tokenizer(_run_cfg(tmp_path)) is None
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer directory"):
        run_tokenizer(_run_cfg(tmp_path, f"model.tokenizer={release}"))


def test_tiny_run_trains_with_isaac_prompts_and_exports_its_tokenizer(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = compose_experiment(
        "groot_n1_6_tiny",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.tokenizer={tokenizer_dir}",
            "train.steps=3",
            "train.micro_batch_size=2",
            "train.global_batch_size=null",
            "optim.lr=1e-3",
            "logging.progress=false",
            "logging.trackers=[]",
            "data.synthetic.num_episodes=2",
            "data.synthetic.episode_length=12",
        ],
        world_size=1,
    )
    result = train(cfg)
    assert len(result.losses) == 3 and torch.isfinite(torch.tensor(result.losses)).all()
    out = capsys.readouterr().out
    assert "Prompts: Isaac-GR00T N1.6's chat prompt" in out and str(tokenizer_dir) in out
    export = tmp_path / "run" / "export"
    assert json.loads((export / "config.json").read_text())["tokenizer"] == str(tokenizer_dir)
    isaac = export / "isaac"
    again = _run_cfg(tmp_path / "next", f"model.init_from={isaac}")
    assert run_tokenizer(again) == isaac / "tokenizer"
    saved = GrootPromptTokenizer(isaac / "tokenizer", get_config("groot_n1_6", "tiny", {}))
    original = GrootPromptTokenizer(tokenizer_dir, get_config("groot_n1_6", "tiny", {}))
    a = saved(TASKS, image_hw=(56, 84), num_cameras=2)
    b = original(TASKS, image_hw=(56, 84), num_cameras=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

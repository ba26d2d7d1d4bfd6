"""pi0.5's prompt with a Hugging Face tokenizer (``model.tokenizer``): ids and masks equal
LeRobot 0.6.1's pi05 preprocessor format on the same tokenizer (a tiny Gemma-style one built
here, nothing downloaded), the state dropped from the prefix, and where the tokenizer of a
run comes from. LeRobot's own processor on the same tokenizer: ``tests/lerobot_parity``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from embodied_testkit import write_tiny_tokenizer

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.train.trainer import typed_config
from longboat.embodied.models import build_model, get_config
from longboat.embodied.models.pi05.lerobot_format import (
    config_from_lerobot,
    lerobot_config_for,
    save_lerobot_pi05,
)
from longboat.embodied.models.pi05.processor import PromptTokenizer, state_bins
from longboat.embodied.models.synthetic import synthetic_batch
from longboat.embodied.train.policy_batch import PolicyCollator, batch_spec
from longboat.embodied.train.reference_formats import prompt_tokenizer, run_tokenizer

ARTIFACT = Path(__file__).parent / "test_data_lerobot_artifacts" / "pi05_tiny_lerobot_0.6.1"
CAMS = ["observation.images.top", "observation.images.wrist"]
MAX_LENGTH = 40  # the tiny flavor's prompt length (LeRobot's tokenizer_max_length)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def reference_prompt(task: str, state: list[float]) -> str:
    """LeRobot's pi05 prompt, re-stated from its documented behaviour: the task stripped,
    ``_`` and newlines as spaces; each state value's bin among 256 equal bins of [-1, 1]
    (the number of the 256 left edges at or below it, minus one)."""
    edges = [-1 + 2 * i / 256 for i in range(256)]
    bins = [sum(e <= np.float32(v) for e in edges) - 1 for v in state]
    text = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {text}, State: {' '.join(str(b) for b in bins)};\nAction: "


def reference_tokens(path: Path, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """LeRobot's tokenizer step: right padding to max_length, truncation, its BOS."""
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(str(path))(
        prompts,
        max_length=MAX_LENGTH,
        truncation=True,
        padding="max_length",
        padding_side="right",
        return_tensors="pt",
    )
    return out["input_ids"], out["attention_mask"].bool()


def _samples() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    tasks = [
        "pick_up the red cube\n",
        "  place the cup in the sink ",
        "stack " + "the green block on the box and " * 6,  # longer than 40 tokens: cut
    ]
    states = [
        torch.tensor([-1.0, 1.0, 0.0, -2 / 256 + 1e-7, 0.5, 0.999]),
        torch.rand(6, generator=gen) * 2 - 1,
        torch.rand(6, generator=gen) * 2 - 1,
    ]
    return [
        {
            "observation.state": state,
            "action": torch.zeros(10, 5),
            "task": task,
            **{cam: torch.rand(3, 56, 56, generator=gen) for cam in CAMS},
        }
        for task, state in zip(tasks, states, strict=True)
    ]


def test_collator_ids_and_mask_equal_lerobots_prompt_format(tokenizer_dir: Path) -> None:
    cfg = get_config("pi05", "tiny", {"state_in_prompt": True})
    spec = batch_spec("pi05", cfg, len(CAMS), (56, 56))
    collate = PolicyCollator(spec, CAMS, prompts=PromptTokenizer(tokenizer_dir, MAX_LENGTH))
    samples = _samples()
    batch = collate(samples)
    prompts = [reference_prompt(s["task"], s["observation.state"].tolist()) for s in samples]
    assert prompts[0] == "Task: pick up the red cube, State: 0 255 128 127 192 255;\nAction: "
    ids, mask = reference_tokens(tokenizer_dir, prompts)
    assert batch["input_ids"].shape == (3, MAX_LENGTH)
    assert torch.equal(batch["input_ids"], ids)
    assert torch.equal(batch["attention_mask"], mask)
    assert batch["input_ids"][:, 0].tolist() == [2, 2, 2]  # the tokenizer's BOS
    assert mask[2].all() and not mask[0].all()  # the long prompt is cut, the short padded
    # Out-of-range values bin as np.digitize does (LeRobot does not clip before it).
    assert state_bins(torch.tensor([-1.5, 1.5, -1.0])).tolist() == [-1, 255, 0]


def test_state_in_prompt_drops_the_state_tokens_and_nothing_else() -> None:
    """With the state spelled in the prompt the prefix ends with the text: the same loss and
    actions as the state tokens masked out."""
    torch.manual_seed(0)
    plain = build_model("pi05", "tiny")
    spelled = build_model("pi05", get_config("pi05", "tiny", {"state_in_prompt": True}))
    spelled.load_state_dict(plain.state_dict())
    plain.eval(), spelled.eval()
    batch = synthetic_batch(plain, 2, seed=1)
    batch["noise"] = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(2))
    batch["time"] = torch.tensor([0.3, 0.7])
    masked = {**batch, "state_mask": torch.zeros_like(batch["state_mask"])}
    with torch.no_grad():
        assert torch.equal(plain(masked)["loss"], spelled(batch)["loss"])
        a = plain.predict_action(masked, noise=batch["noise"])
        b = spelled.predict_action(batch, noise=batch["noise"])
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert config_from_lerobot(json.loads((ARTIFACT / "config.json").read_text())).state_in_prompt


def _lerobot_checkpoint(directory: Path) -> Path:
    raw = json.loads((ARTIFACT / "config.json").read_text())
    model = build_model("pi05", config_from_lerobot(raw))
    cfg = lerobot_config_for(model, state_dim=6, action_dim=5, camera_keys=CAMS, base=raw)
    return save_lerobot_pi05(model, directory, cfg)


def _run_cfg(tmp_path: Path, *overrides: str):
    cfg = compose_experiment(
        "pi05_tiny", [f"output_dir={tmp_path / 'run'}", *overrides], world_size=1
    )
    return typed_config(cfg)


def test_where_the_tokenizer_of_a_run_comes_from(tmp_path: Path, tokenizer_dir: Path) -> None:
    ckpt = _lerobot_checkpoint(tmp_path / "ckpt")
    # A pretrained pi0.5 without a tokenizer: one error naming the key.
    with pytest.raises(ConfigError, match=re.escape("model.tokenizer")) as err:
        run_tokenizer(_run_cfg(tmp_path, f"model.init_from={ckpt}"))
    assert "PaliGemma's tokenizer" in str(err.value)
    # Given, or found in the checkpoint's tokenizer/ folder (what our export writes).
    given = _run_cfg(tmp_path, f"model.init_from={ckpt}", f"model.tokenizer={tokenizer_dir}")
    assert run_tokenizer(given) == tokenizer_dir
    write_tiny_tokenizer(ckpt / "tokenizer")
    assert run_tokenizer(_run_cfg(tmp_path, f"model.init_from={ckpt}")) == ckpt / "tokenizer"
    # From scratch: none needed (the byte-level stand-in), none used.
    assert run_tokenizer(_run_cfg(tmp_path)) is None
    # Not a tokenizer directory, or more ids than the model's vocabulary: ConfigErrors.
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer directory"):
        run_tokenizer(_run_cfg(tmp_path, f"model.tokenizer={tmp_path}"))
    big = write_tiny_tokenizer(tmp_path / "big", extra_tokens=1000)
    with pytest.raises(ConfigError, match="more than the model's vocabulary of 1024"):
        prompt_tokenizer(big, "pi05", get_config("pi05", "tiny", {}))


def test_formats_are_checked_per_family(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="isaac is written for groot_n1_6"):
        compose_experiment(
            "pi05_tiny", [f"output_dir={tmp_path}", "export.format=isaac"], world_size=1
        )
    with pytest.raises(ConfigError, match="does not write this format"):
        compose_experiment(
            "pi05_tiny", [f"output_dir={tmp_path}", "export.format=onnx"], world_size=1
        )

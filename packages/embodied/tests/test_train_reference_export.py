"""A finished run writes its policy in the reference format itself (``export.format``):
pi0.5 as a LeRobot directory with processors and tokenizer, GR00T in the Isaac-GR00T N1.6
layout with its normaliser statistics; ``model.init_from`` loads both back with equal
actions, and an Isaac directory's statistics normalise the next run (a round trip keeps
the normaliser). LeRobot's ``from_pretrained`` on the pi0.5 directory:
``tests/lerobot_parity``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from embodied_testkit import write_tiny_tokenizer

from longboat.core.config.compose import compose_experiment
from longboat.core.config.errors import ConfigError
from longboat.core.train.trainer import typed_config
from longboat.embodied.data import LeRobotDataset
from longboat.embodied.inference import load_policy
from longboat.embodied.models.groot_n1_6.isaac_format import load_isaac_groot
from longboat.embodied.models.groot_n1_6.isaac_processor import checkpoint_stats
from longboat.embodied.models.init_from import resolve_model_config
from longboat.embodied.models.pi05.lerobot_format import load_lerobot_pi05
from longboat.embodied.models.pi05.lerobot_processors import preprocessor_overrides
from longboat.embodied.models.synthetic import synthetic_batch
from longboat.embodied.train.export import load_exported_policy
from longboat.embodied.train.reference_formats import run_tokenizer
from longboat.embodied.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(experiment: str, run: Path, *overrides: str):
    return compose_experiment(
        experiment,
        [
            f"output_dir={run}",
            "train.steps=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=null",
            "optim.lr=1e-3",
            "logging.progress=false",
            "logging.trackers=[]",
            "data.synthetic.num_episodes=2",
            "data.synthetic.episode_length=12",
            *overrides,
        ],
        world_size=1,
    )


def _same_actions(a: torch.nn.Module, b: torch.nn.Module, batch: dict) -> None:
    a.eval(), b.eval()
    noise = torch.randn(
        batch["state"].shape[0], a.cfg.action_horizon, batch["action"].shape[-1],
        generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    torch.testing.assert_close(
        a.predict_action(batch, noise=noise),
        b.predict_action(batch, noise=noise),
        rtol=0,
        atol=1e-6,
    )


def test_pi05_run_ends_with_a_lerobot_policy_that_init_from_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    tokenizer = write_tiny_tokenizer(tmp_path / "tokenizer")
    run = tmp_path / "run"
    assert len(train(_cfg("pi05_tiny", run, f"model.tokenizer={tokenizer}")).losses) == 2
    out = capsys.readouterr().out
    lerobot = run / "export" / "lerobot"
    assert f"LeRobot pi0.5: {lerobot} (model.init_from, PI05Policy.from_pretrained)" in out
    assert f"Prompts: pi0.5's 'Task: ..., State: ...;\\nAction: ' tokenised by {tokenizer}" in out
    steps = json.loads((lerobot / "policy_preprocessor.json").read_text())["steps"]
    step = next(s for s in steps if s["registry_name"] == "tokenizer_processor")
    assert step["config"]["tokenizer_name"] == "tokenizer"  # relative: the folder can move
    assert step["config"]["max_length"] == 40
    assert (lerobot / "tokenizer" / "tokenizer.json").read_bytes() == (
        tokenizer / "tokenizer.json"
    ).read_bytes()
    # model.init_from reads it back: architecture, weights, the tokenizer beside them.
    ours = load_exported_policy(run / "export")
    theirs, lerobot_cfg = load_lerobot_pi05(lerobot)
    assert lerobot_cfg["normalization_mapping"]["STATE"] == "MIN_MAX"
    resolve_model_config("pi05", "tiny", {}, str(lerobot))
    again = typed_config(_cfg("pi05_tiny", tmp_path / "next", f"model.init_from={lerobot}"))
    assert run_tokenizer(again) == lerobot / "tokenizer"
    assert theirs.cfg.state_in_prompt and ours.cfg.state_in_prompt
    _same_actions(ours, theirs, synthetic_batch(ours, 2, seed=3))

    # Moved away (the run's tokenizer gone too), the folder is still whole: model.init_from
    # and load_policy find its tokenizer, LeRobot's relative tokenizer_name resolves in it.
    moved = tmp_path / "elsewhere" / "pi05_policy"
    shutil.move(lerobot, moved)
    shutil.rmtree(tokenizer)
    after = typed_config(_cfg("pi05_tiny", tmp_path / "after", f"model.init_from={moved}"))
    assert run_tokenizer(after) == moved / "tokenizer"
    assert preprocessor_overrides(moved) == {
        "tokenizer_processor": {"tokenizer_name": str((moved / "tokenizer").resolve())}
    }
    frame = LeRobotDataset(run / "dataset")[3]
    noise = torch.randn(10, 8, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        load_policy(moved).predict_action_chunk(frame, noise=noise),
        load_policy(run / "export").predict_action_chunk(frame, noise=noise),
        rtol=0,
        atol=1e-5,
    )

    # The byte-level stand-in writes no LeRobot directory (LeRobot would read other tokens).
    byte_run = tmp_path / "byte"
    train(_cfg("pi05_tiny", byte_run, "train.steps=1", "model.tokenizer=byte"))
    out = capsys.readouterr().out
    assert "Prompts: task text through the byte-level stand-in tokenizer" in out
    assert "Export: native only (export.format=auto): the byte-level stand-in" in out
    assert not (byte_run / "export" / "lerobot").exists()
    with pytest.raises(ConfigError, match=re.escape("export.format")):
        train(
            _cfg(
                "pi05_tiny",
                tmp_path / "byte2",
                "train.steps=1",
                "model.tokenizer=byte",
                "export.format=lerobot",
            )
        )


def test_pi05_from_scratch_ships_its_tokenizer_in_a_lerobot_export(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No tokenizer key: the run writes its stand-in tokenizer, trains on LeRobot's prompt
    and ends with a LeRobot directory holding that tokenizer, whose ids LeRobot's
    tokenizer step (AutoTokenizer on the folder's tokenizer/) reproduces."""
    from transformers import AutoTokenizer

    from longboat.embodied.models.pi05.processor import PromptTokenizer, pi05_prompt

    run = tmp_path / "run"
    train(_cfg("pi05_tiny", run, "train.steps=1"))
    out = capsys.readouterr().out
    lerobot = run / "export" / "lerobot"
    assert f"LeRobot pi0.5: {lerobot} (model.init_from, PI05Policy.from_pretrained)" in out
    assert f"tokenised by {run / 'tokenizer'}" in out
    steps = json.loads((lerobot / "policy_preprocessor.json").read_text())["steps"]
    step = next(s for s in steps if s["registry_name"] == "tokenizer_processor")
    assert step["config"]["tokenizer_name"] == "tokenizer"
    shipped = lerobot / "tokenizer" / "tokenizer.json"
    assert shipped.read_bytes() == (run / "tokenizer" / "tokenizer.json").read_bytes()
    ds = LeRobotDataset(run / "dataset", normalization={"observation.state": "min_max"})
    samples = [ds[i] for i in (0, 9)]
    ids, mask = PromptTokenizer(run / "tokenizer", 40)(
        [s["task"] for s in samples], [s["observation.state"] for s in samples]
    )
    assert int(mask.sum(1).max()) < 40  # the whole prompt fits: nothing cut
    name = preprocessor_overrides(lerobot)["tokenizer_processor"]["tokenizer_name"]
    theirs = AutoTokenizer.from_pretrained(name)(
        [pi05_prompt(s["task"], s["observation.state"]) for s in samples],
        max_length=40,
        truncation=True,
        padding="max_length",
        padding_side="right",
        return_tensors="pt",
    )
    assert torch.equal(theirs["input_ids"], ids)
    again = typed_config(_cfg("pi05_tiny", tmp_path / "next", f"model.init_from={lerobot}"))
    assert run_tokenizer(again) == lerobot / "tokenizer"


def test_groot_run_keeps_its_normaliser_through_the_isaac_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    train(_cfg("groot_n1_6_tiny", run, "train.steps=1"))
    isaac = run / "export" / "isaac"
    assert f"Isaac-GR00T N1.6: {isaac} (model.init_from)" in capsys.readouterr().out
    dataset_stats = json.loads((run / "dataset" / "meta" / "stats.json").read_text())
    modality = json.loads((run / "dataset" / "meta" / "modality.json").read_text())
    statistics = json.loads((isaac / "statistics.json").read_text())
    assert list(statistics) == ["new_embodiment"]
    groups = statistics["new_embodiment"]["state"]
    assert list(groups) == list(modality["state"])  # GR00T's joint groups, in order
    for name, spec in modality["state"].items():
        for stat in ("min", "max", "mean", "std", "q01", "q99"):
            want = dataset_stats["observation.state"][stat][spec["start"] : spec["end"]]
            assert groups[name][stat] == pytest.approx(want, rel=0, abs=0), (name, stat)
    processor = json.loads((isaac / "processor_config.json").read_text())
    kwargs = processor["processor_kwargs"]
    assert processor["processor_class"] == "Gr00tN1d6Processor"
    assert (kwargs["use_percentiles"], kwargs["clip_outliers"]) == (False, True)
    tag_cfg = kwargs["modality_configs"]["new_embodiment"]
    assert tag_cfg["action"]["delta_indices"] == list(range(10))  # the tiny horizon
    cameras = json.loads((run / "export" / "config.json").read_text())["cameras"]
    assert tag_cfg["video"]["modality_keys"] == [c.rsplit(".", 1)[-1] for c in cameras]
    assert json.loads((isaac / "embodiment_id.json").read_text()) == {"new_embodiment": 0}
    ours = load_exported_policy(run / "export")
    theirs, _ = load_isaac_groot(isaac)
    _same_actions(ours, theirs, synthetic_batch(ours, 2, seed=3))

    # A next run from that directory normalises with its statistics, not the dataset's
    # (here made different), and writes them back unchanged.
    for group in statistics["new_embodiment"]["action"].values():
        group["min"] = [v - 1.0 for v in group["min"]]
        group["max"] = [v * 2.0 + 0.5 for v in group["max"]]
    (isaac / "statistics.json").write_text(json.dumps(statistics))
    widths = {"observation.state": 6, "action": 5}
    used = checkpoint_stats(isaac, "new_embodiment", widths)
    lo = np.concatenate([g["min"] for g in statistics["new_embodiment"]["action"].values()])
    assert np.array_equal(used["action"]["min"], lo)
    second = tmp_path / "second"
    train(
        _cfg(
            "groot_n1_6_tiny",
            second,
            "train.steps=1",
            f"model.init_from={isaac}",
            f"data.path={run / 'dataset'}",
        )
    )
    assert "Normaliser: the statistics.json of model.init_from for sub-dataset(s) [0]" in (
        capsys.readouterr().out
    )
    back = json.loads((second / "export" / "isaac" / "statistics.json").read_text())
    assert back == statistics
    with pytest.raises(
        ConfigError, match=re.escape("has 6 state dims, the dataset's observation.state 7")
    ):
        checkpoint_stats(isaac, "new_embodiment", {"observation.state": 7, "action": 5})
    assert checkpoint_stats(isaac, "gr1", widths) is None

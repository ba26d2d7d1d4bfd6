"""LLaVA-OneVision-style composition from config: one Hydra line per part, the joints
validated before anything is built (errors name the keys), any core decoder family builds
and runs, and ``longboat-vlm train`` trains the composed tiny model on the shapes data, exports it and
answers held-out questions through ``transformers``' generate on the export."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess
from longboat.vlm.models.llava_onevision.config import compose
from longboat.vlm.models.llava_onevision.model import flavor

TINY = flavor("tiny")


def _compose(overrides: list[str]) -> Any:
    from longboat.core.config.compose import compose_experiment

    return compose_experiment("quickstart", overrides, stack="vlm")


def _model_cfg(overrides: list[str]) -> Any:
    from longboat.vlm.train.training import model_config

    return model_config(_compose(overrides))


def test_one_line_per_part() -> None:
    cfg = _model_cfg(["model=llava_onevision_tiny"])
    assert cfg == TINY
    cfg = _model_cfg(["model=llava_onevision_tiny", "model/llm@model.language=qwen3_tiny"])
    assert (cfg.language.name, cfg.language.qk_norm, cfg.language.vocab_size) == (
        "qwen3",
        True,
        384,
    )
    assert cfg.projector.output_size == cfg.language.hidden_size == 64
    cfg = _model_cfg(["model=llava_onevision_tiny", "model/llm@model.language=llama3_tiny",
                      "model.language.hidden_size=96"])  # fmt: skip
    assert (cfg.language.name, cfg.projector.output_size) == ("llama3", 96)
    cfg = _model_cfg(["model=llava_onevision_tiny", "model/vision=siglip_so400m",
                      "model/llm@model.language=qwen3_1_7b"])  # fmt: skip
    assert (cfg.vision.hidden_size, cfg.vision.num_layers, cfg.vision.image_size) == (1152, 26, 384)
    assert (cfg.projector.input_size, cfg.projector.output_size) == (1152, 2048)
    assert cfg.language.num_layers == 28


@pytest.mark.parametrize(
    ("sections", "keys"),
    [
        ({"projector": {"output_size": 48}}, ["model.projector.output_size=48",
                                              "model.language.hidden_size=64"]),
        ({"projector": {"input_size": 16}}, ["model.projector.input_size=16",
                                             "model.vision.hidden_size=32"]),
        ({"language": {"vocab_size": 300}}, ["model.image_token_id=310",
                                             "model.language.vocab_size=300"]),
        ({"language": {"name": "gpt9"}}, ["model.language.name='gpt9'"]),
        ({"language": {"name": "qwen3", "flavor": "huge"}}, ["model.language.flavor='huge'"]),
        ({"language": {"hiden_size": 8}}, ["model.language.hiden_size"]),
        ({"language": {"mrope_section": [2, 3, 3]}}, ["model.language.mrope_section"]),
        ({"vision": {"num_heads": 5}}, ["model.vision.num_heads=5", "model.vision.hidden_size=32"]),
        ({"vision": {"flavor": "g"}}, ["model.vision.flavor='g'"]),
        ({"projector": {"name": "qformer"}}, ["model.projector.name='qformer'"]),
    ],
)  # fmt: skip
def test_joints_are_validated(sections: dict, keys: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        compose(TINY, **sections)
    for key in keys:
        assert key in str(err.value), (key, str(err.value))


def test_other_fields_are_validated() -> None:
    bad = dataclasses.replace(TINY, image_grid_pinpoints=((16, 20),))
    with pytest.raises(ConfigError, match=r"model.image_grid_pinpoints has \[\[16, 20\]\]"):
        bad.validate()
    with pytest.raises(ConfigError, match=r"model.vision_aspect_ratio='anyres'"):
        dataclasses.replace(TINY, vision_aspect_ratio="anyres").validate()
    with pytest.raises(ConfigError, match=r"model.vision_feature_layer=5"):
        dataclasses.replace(TINY, vision_feature_layer=5).validate()


def test_sections_refused_by_other_families() -> None:
    with pytest.raises(ConfigError, match=r"model\.language"):
        _model_cfg(["model.language.name=qwen3"])


def _forward_worker(rank: int, world: int, languages: list[dict]) -> list[tuple]:
    from longboat.core.config.schema import ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.vlm.data.llava_processor import LlavaVisionProcessor
    from longboat.vlm.models.llava_onevision.model import build

    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"))
    out = []
    try:
        for language in languages:
            torch.manual_seed(0)
            cfg = compose(TINY, language=language)
            model = build(cfg)
            processor = cfg.vision_processor()
            assert isinstance(processor, LlavaVisionProcessor)
            image = torch.randint(0, 256, (21, 34, 3), dtype=torch.uint8).numpy()
            px = processor.preprocess_images([image])
            n = processor.grid_tokens(px["image_grid_thw"][0].tolist())
            ids = torch.tensor([[1, 2, *([cfg.image_token_id] * n), 3, 4]])
            logits = model(ids, **px)
            loss = model(ids, **px, labels=ids).float().mean()
            loss.backward()
            grads = [p.grad for p in model.vision.parameters() if p.requires_grad]
            out.append((cfg.language.name, tuple(logits.shape), bool(torch.isfinite(logits).all()),
                        all(g is not None and torch.isfinite(g).all() for g in grads)))  # fmt: skip
    finally:
        parallel_state.destroy()
    return out


@pytest.mark.multiprocess
def test_qwen3_and_llama3_decoders_build_and_run() -> None:
    langs = [{"name": "qwen3", "flavor": "tiny", "vocab_size": 384},
             {"name": "llama3", "flavor": "tiny", "vocab_size": 384, "hidden_size": 48}]  # fmt: skip
    (got,) = run_multiprocess(_forward_worker, 1, langs, timeout=300)
    assert [g[0] for g in got] == ["qwen3", "llama3"]
    for name, shape, finite, grads in got:
        assert shape[0] == 1 and shape[2] == 384 and finite and grads, name


def _train_worker(rank: int, world: int, overrides: list[str]) -> dict:
    from longboat.vlm.train.training import train

    result = train(_compose(overrides))
    return {"losses": result.losses, "export": str(result.export_dir), "extra": dict(result.extra)}


@pytest.mark.multiprocess
def test_train_two_steps_and_export(tmp_path: Path) -> None:
    from transformers import LlavaOnevisionForConditionalGeneration

    overrides = [
        "model=llava_onevision_tiny",
        f"output_dir={tmp_path / 'run'}",
        f"data.out_dir={tmp_path / 'data'}",
        "data.num_train=12",
        "data.num_eval=4",
        "data.seq_len=256",
        "train.steps=2",
        "train.eval_every=0",
        "train.log_every=1",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=0",
        "vlm.answer_eval_samples=2",  # transformers generates from the export
        "vlm.eval_batches=1",
    ]
    (got,) = run_multiprocess(_train_worker, 1, overrides, timeout=300)
    losses = [v for _, v in sorted(got["losses"].items())] if isinstance(got["losses"], dict) \
        else list(got["losses"])  # fmt: skip
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses
    export = Path(got["export"])
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(export)
    assert model.config.text_config.model_type == "qwen2"
    assert (export / "preprocessor_config.json").is_file()
    assert got["extra"]["answers_asked"] == 2

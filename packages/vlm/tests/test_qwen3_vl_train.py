"""``longboat-vlm train model=qwen3_vl_tiny`` on the generated shapes set (CPU, gloo).

A short run learns (the loss falls), exports a directory ``transformers`` loads as
``Qwen3VLForConditionalGeneration`` (with Qwen3-VL's image normalisation in its
``preprocessor_config.json``) and answers held-out questions from it; activation recompute
of both components (the deepstack injection replayed inside the decoder's recompute) gives
the same losses; a pipeline split whose first stage would not hold the deepstack layers is
refused. (Videos: ``test_qwen3_vl_video.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longboat.core.distributed import run_multiprocess


def _overrides(out: Path, data: Path, *extra: str) -> list[str]:
    return [
        "model=qwen3_vl_tiny",
        f"output_dir={out}",
        f"data.out_dir={data}",
        "data.num_train=24",
        "data.num_eval=4",
        "data.seq_len=256",
        "train.steps=6",
        "train.eval_every=0",
        "train.log_every=1",
        "logging.progress=false",
        "logging.trackers=[]",
        "checkpoint.every_steps=0",
        "vlm.answer_eval_samples=0",
        "export.enabled=false",
        "vlm.eval_batches=1",
        *extra,
    ]


def _compose(overrides: list[str]):
    from longboat.core.config.compose import compose_experiment

    return compose_experiment("quickstart", overrides, stack="vlm")


def _train_worker(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    from longboat.vlm.train.training import train

    out = []
    for overrides in runs:
        result = train(_compose(overrides))
        out.append({"losses": list(result.losses), "export": str(result.export_dir),
                    "extra": dict(result.extra)})  # fmt: skip
    return out


@pytest.mark.multiprocess
def test_train_recompute_export_answer(tmp_path: Path) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    data = tmp_path / "data"
    plain = _overrides(tmp_path / "plain", data, "export.enabled=true", "vlm.answer_eval_samples=2")
    recompute = _overrides(tmp_path / "recompute", data, "train.recompute=full")
    got, again = run_multiprocess(_train_worker, 1, [plain, recompute], timeout=400)[0]
    losses = got["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert max(abs(a - b) for a, b in zip(losses, again["losses"], strict=True)) < 1e-5
    export = Path(got["export"])
    model = Qwen3VLForConditionalGeneration.from_pretrained(export)
    assert model.config.vision_config.deepstack_visual_indexes == [0, 1]
    pre = json.loads((export / "preprocessor_config.json").read_text())
    assert pre["image_mean"] == [0.5, 0.5, 0.5] and pre["patch_size"] == 4
    assert got["extra"]["answers_asked"] == 2


def test_pipeline_split_must_keep_deepstack_on_the_first_stage(tmp_path: Path) -> None:
    from longboat.core.config.errors import ConfigError
    from longboat.vlm.train.training import build_training

    # 4 decoder layers over 4 stages: the first holds 1 of the 2 deepstack layers.
    overrides = _overrides(tmp_path / "out", tmp_path / "data", "parallel.pipeline_parallel=4")
    with pytest.raises(ConfigError, match=r"parallel.pipeline_parallel=4: the first stage would"):
        build_training(_compose(overrides))
    assert not (tmp_path / "data").exists(), "refused before the data was prepared"

    def worker(rank: int, world: int) -> str:
        from longboat.core.config.schema import ParallelConfig
        from longboat.core.device import get_accelerator
        from longboat.core.megatron import parallel_state
        from longboat.vlm.models.qwen3_vl.model import build, flavor

        cfg = flavor("tiny")  # 2 deepstack features; 2 decoder layers = 1 per stage
        cfg.language.num_layers = 2
        parallel_state.initialize(ParallelConfig(pipeline_parallel=2), get_accelerator("cpu"))
        try:
            build(cfg)
        except ConfigError as exc:
            return str(exc)
        finally:
            parallel_state.destroy()
        return "built"

    # build() refuses it too (the Python API skips the run's checks).
    (msg, _) = run_multiprocess(worker, 2, timeout=120)
    assert "parallel.pipeline_parallel=2" in msg and "deepstack" in msg

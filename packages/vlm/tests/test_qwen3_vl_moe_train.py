"""``longboat-vlm train experiment=qwen3_vl_moe_tiny`` on the generated shapes set (CPU).

The command line trains the tiny Qwen3-VL-MoE a few steps (the loss falls) and exports a
directory ``transformers`` loads as ``Qwen3VLMoeForConditionalGeneration``; expert
parallelism over two gloo ranks (EP=2, DP=2) and a 4-layer decoder over two pipeline
stages train the same losses as one process with the same global batch and weights (the
load-balancing term, weighted 0.5 so its scale shows, a mean over the microbatches either
way); tensor parallelism under the MoE decoder is refused before the data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longboat.core.distributed import run_multiprocess


def _overrides(out: Path, data: Path, *extra: str) -> list[str]:
    return [
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
        "vlm.eval_batches=1",
        *extra,
    ]


def _losses(out: Path) -> list[float]:
    rows = [
        json.loads(line)
        for line in (out / "logs" / "qwen3_vl_moe_tiny" / "metrics.jsonl").read_text().splitlines()
    ]
    return [r["loss"] for r in rows if "loss" in r]


def test_cli_trains_and_exports(tmp_path: Path) -> None:
    from transformers import Qwen3VLMoeForConditionalGeneration

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "longboat.vlm.cli", "train", "experiment=qwen3_vl_moe_tiny",
           *_overrides(out, tmp_path / "data", "export.enabled=true")]  # fmt: skip
    run = subprocess.run(
        cmd, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Model qwen3_vl_moe/tiny" in run.stdout
    losses = _losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(out / "hf")
    assert model.config.text_config.num_experts == 4


def _compose(overrides: list[str], experiment: str = "qwen3_vl_moe_tiny"):
    from longboat.core.config.compose import compose_experiment

    return compose_experiment(experiment, overrides, stack="vlm")


def _train_worker(rank: int, world: int, overrides: list[str]) -> list[float]:
    from longboat.vlm.train.training import train

    return list(train(_compose(overrides, "quickstart")).losses)


def _initial_hf(tmp_path: Path, overrides: list[str], num_layers: int | None = None) -> Path:
    """Random HF weights of the run's model (its tokenizer's token ids; ``num_layers``
    decoder layers) for both runs: a from-scratch init draws each expert-parallel rank's
    experts (each pipeline stage's layers) from another stream."""
    import dataclasses

    import torch
    from transformers import Qwen3VLMoeForConditionalGeneration

    from longboat.core.train import typed_config
    from longboat.vlm.models.qwen3_vl_moe.model import to_hf_config
    from longboat.vlm.train.data import open_run_data
    from longboat.vlm.train.training import model_config

    cfg = typed_config(_compose(overrides, "quickstart"))
    model_cfg = open_run_data(cfg, model_config(cfg)).model_cfg
    # a load-balancing weight large enough that its scale shows in the losses
    language = dataclasses.replace(
        model_cfg.language,
        num_layers=num_layers or model_cfg.language.num_layers,
        moe_aux_loss_coeff=0.5,
    )
    model_cfg = dataclasses.replace(model_cfg, language=language)
    torch.manual_seed(0)
    out = tmp_path / "init_hf"
    Qwen3VLMoeForConditionalGeneration(to_hf_config(model_cfg)).save_pretrained(out)
    return out


@pytest.mark.multiprocess
def test_ep2_trains_like_one_process(tmp_path: Path) -> None:
    data = tmp_path / "data"
    common = ["model=qwen3_vl_moe_tiny", "train.global_batch_size=2", "train.steps=4",
              "export.enabled=false", "vlm.answer_eval_samples=0"]  # fmt: skip
    init = (
        f"model.init_from={_initial_hf(tmp_path, _overrides(tmp_path / 'unused', data, *common))}"
    )
    one = run_multiprocess(
        _train_worker, 1, _overrides(tmp_path / "one", data, *common, init), timeout=400
    )[0]
    ep2 = _overrides(tmp_path / "ep2", data, *common, init, "parallel.expert_parallel=2")
    for got in run_multiprocess(_train_worker, 2, ep2, timeout=400):
        assert max(abs(a - b) for a, b in zip(got, one, strict=True)) < 1e-5, (got, one)
    assert one[-1] < one[0], one


@pytest.mark.multiprocess
def test_pp2_trains_like_one_process(tmp_path: Path) -> None:
    """A 4-layer decoder over two stages (1F1B, the load-balancing term scaled by megatron's
    schedule) trains the losses of one process from the same weights."""
    data = tmp_path / "data"
    common = ["model=qwen3_vl_moe_tiny", "train.global_batch_size=2", "train.steps=3",
              "export.enabled=false", "vlm.answer_eval_samples=0"]  # fmt: skip
    hf = _initial_hf(tmp_path, _overrides(tmp_path / "unused", data, *common), num_layers=4)
    init = f"model.init_from={hf}"
    one = run_multiprocess(
        _train_worker, 1, _overrides(tmp_path / "one", data, *common, init), timeout=400
    )[0]
    pp2 = _overrides(tmp_path / "pp2", data, *common, init, "parallel.pipeline_parallel=2")
    for got in run_multiprocess(_train_worker, 2, pp2, timeout=400):
        assert max(abs(a - b) for a, b in zip(got, one, strict=True)) < 1e-5, (got, one)


def test_composed_model_is_the_flavor() -> None:
    """The experiment's model group (the decoder in one line) composes the ``tiny`` flavor;
    the decoder line names any qwen3_moe option."""
    from longboat.core.train import typed_config
    from longboat.vlm.models.qwen3_vl_moe.model import flavor
    from longboat.vlm.train.training import model_config

    cfg = model_config(typed_config(_compose([])))
    assert cfg.architecture() == flavor("tiny").architecture()
    swap = ["model/llm@model.language=qwen3_moe_30b_a3b", "model.flavor=30b_a3b"]
    big = model_config(typed_config(_compose([*swap, "model.language.rope_theta=5000000.0"])))
    assert big.architecture() == flavor("30b_a3b").architecture()


def test_tensor_parallel_is_refused_before_the_data(tmp_path: Path) -> None:
    from longboat.core.config.errors import ConfigError
    from longboat.vlm.train.training import build_training

    overrides = _overrides(tmp_path / "out", tmp_path / "data", "parallel.tensor_parallel=2")
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel=2: an MoE decoder"):
        build_training(_compose(overrides))
    assert not (tmp_path / "data").exists(), "refused before the data was prepared"


def _non_bf16_worker(rank: int, world: int, output_dir: str) -> list[str]:
    import torch

    from longboat.core.train import typed_config
    from longboat.vlm.train.training import build_training

    raw = _compose(["vlm.cpu_precision=bf16", f"output_dir={output_dir}"])
    model = build_training(typed_config(raw)).step_fn.model
    return [n for n, p in model.named_parameters() if p.dtype != torch.bfloat16]


@pytest.mark.multiprocess
def test_a_bf16_run_builds_every_parameter_in_bf16(tmp_path: Path) -> None:
    """The tower's megatron LayerNorms too (megatron makes them fp32 for a Float16Module to
    cast; CUDA's layer_norm refuses fp32 weights beside bf16 activations). In a forked
    worker: a built run leaves threads behind."""
    (not_bf16,) = run_multiprocess(_non_bf16_worker, 1, str(tmp_path), timeout=600)
    assert not_bf16 == [], not_bf16

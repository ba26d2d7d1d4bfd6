"""On CUDA: the quickstart trains in bf16 on longboat's kernels (the loss halves in 60
steps), exports, and the export answers through transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def test_quickstart_trains_on_cuda(tmp_path: Path) -> None:
    from longboat.core.config.compose import compose_experiment
    from longboat.vlm.train.training import train

    cfg = compose_experiment(
        "quickstart",
        [
            f"output_dir={tmp_path}",
            "data.num_train=200",
            "data.num_eval=20",
            "train.steps=60",
            "train.eval_every=0",
            "logging.progress=false",
            "vlm.answer_eval_samples=4",
        ],
        stack="vlm",
    )
    result = train(cfg)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.5 * first, f"bf16 CUDA loss {first:.3f} -> {last:.3f} in 60 steps"
    assert result.extra["answers_asked"] == 4
    assert (Path(result.export_dir) / "model.safetensors").is_file()

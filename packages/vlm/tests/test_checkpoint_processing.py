"""A fine-tune sees images as its checkpoint was trained on them, and its export's processor
loads in ``transformers`` (CPU, a tiny random Qwen2.5-VL checkpoint, no downloads).

The checkpoint's ``preprocessor_config.json`` says ``max_pixels`` 12544: the run resizes
within it (``data.max_pixels`` unset) and says where the bounds came from, or takes
``data.max_pixels`` and says it replaced the checkpoint's. ``AutoProcessor`` loads the
export and gives the pixels and grids the run trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from vlm_testkit import make_qwen2_5_vl_checkpoint


@pytest.fixture(scope="module")
def user_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from longboat.vlm.data.shapes_dataset import make_shapes_dataset

    root = tmp_path_factory.mktemp("vlm_ckpt")
    shapes = make_shapes_dataset(root / "shapes", 8, seed=0, size=160)
    return {"ckpt": make_qwen2_5_vl_checkpoint(root / "ckpt"), "train": shapes.train}


def _run_data(user_files: dict[str, Path], *extra: str):
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import typed_config
    from longboat.vlm.train.data import open_run_data
    from longboat.vlm.train.training import model_config

    overrides = [f"model.init_from={user_files['ckpt']}", f"data.paths=[{user_files['train']}]",
                 "data.seq_len=512", "data.eval_fraction=0", *extra]  # fmt: skip
    cfg = typed_config(compose_experiment("sft", overrides, stack="vlm", world_size=1))
    return open_run_data(cfg, model_config(cfg))


def test_the_checkpoints_pixel_bounds_are_kept_and_said(user_files) -> None:
    data = _run_data(user_files)
    assert data.processor_config.max_pixels == 12544 and data.processor_config.min_pixels == 64
    said = [n for n in data.notes if n.startswith("Images:")]
    assert said == [
        f"Images: min_pixels=64, max_pixels=12544 from {user_files['ckpt']}/"
        "preprocessor_config.json (data.min_pixels / data.max_pixels=<pixels> to change)."
    ]
    # 160 x 160 = 25600 pixels: shrunk under 12544, in multiples of patch 4 x merge 2.
    grid = data.train.samples[0].image_grid_thw.tolist()[0]
    assert grid[1] * grid[2] * 16 <= 12544 and grid[1] == grid[2]


def test_data_max_pixels_replaces_the_checkpoints_and_says_so(user_files) -> None:
    data = _run_data(user_files, "data.max_pixels=4096")
    assert data.processor_config.max_pixels == 4096 and data.processor_config.min_pixels == 64
    said = [n for n in data.notes if n.startswith("Images:")]
    assert said[0] == (
        f"Images: data.max_pixels=4096 replaces the checkpoint's max_pixels=12544 "
        f"({user_files['ckpt']}/preprocessor_config.json); the export carries 4096."
    )


def test_autoprocessor_loads_the_export_and_processes_as_the_run(user_files, tmp_path) -> None:
    import shutil

    from PIL import Image
    from transformers import AutoImageProcessor, AutoProcessor

    data = _run_data(user_files)
    export = tmp_path / "export"
    export.mkdir()
    shutil.copy(user_files["ckpt"] / "config.json", export / "config.json")
    data.save_processing(export)
    assert json.loads((export / "preprocessor_config.json").read_text())["max_pixels"] == 12544
    image = Image.open(user_files["train"].parent / "images" / "00001.png").convert("RGB")
    ours = data.train.encoder.processor.preprocess_images([image])
    # transformers' PIL backend is the run's processing, bit for bit ...
    pil = AutoImageProcessor.from_pretrained(str(export), backend="pil")
    want = pil(images=[image], return_tensors="pt")
    assert want["image_grid_thw"].tolist() == ours["image_grid_thw"].tolist()
    assert np.array_equal(want["pixel_values"].numpy(), ours["pixel_values"].numpy())
    # ... and AutoProcessor (torchvision's resize, transformers' default) within a uint8 step.
    processor = AutoProcessor.from_pretrained(str(export))
    got = processor.image_processor(images=[image], return_tensors="pt")
    assert got["image_grid_thw"].tolist() == ours["image_grid_thw"].tolist()
    step = 1 / 255 / min(data.processor_config.image_std)
    diff = np.abs(got["pixel_values"].numpy() - ours["pixel_values"].numpy()).max()
    assert diff <= step * 1.01, diff

"""The README's fine-tune trial, run as written (bash, the installed console script) on a few
captioned clips and images: a tiny random pipeline, ``data prepare``, ``train``, and the
export loaded by ``DiffusionPipeline.from_pretrained`` sampling a GIF."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("diffusers")

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- tests/test_readme_finetune.py runs this block as written -->"


def readme_block() -> str:
    """The bash block right after the marker in the README."""
    text = README.read_text()
    assert MARKER in text, "the README lost the fine-tune trial's marker"
    rest = text.split(MARKER, 1)[1].lstrip()
    assert rest.startswith("```bash\n")
    return rest[len("```bash\n") :].split("\n```\n", 1)[0]


def _write_inputs(root: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    clips = root / "clips"
    clips.mkdir()
    with av.open(str(clips / "a.mp4"), "w") as c:
        s = c.add_stream("libx264", rate=8)
        s.height, s.width, s.pix_fmt = 40, 48, "yuv420p"
        for k in range(9):
            frame = np.full((40, 48, 3), 60, dtype=np.uint8)
            frame[12:28, 4 + 4 * k : 20 + 4 * k] = (220, 30, 30)
            for pkt in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    (clips / "a.txt").write_text("a red square moving right\n")
    for name, caption in (("b", "a blue stripe"), ("c", "noise on grey")):
        img = rng.integers(0, 256, (36, 44, 3), dtype=np.uint8)
        Image.fromarray(img).save(clips / f"{name}.png")
        (clips / f"{name}.txt").write_text(caption + "\n")


def test_the_readme_fine_tune_trial_ends_with_a_pipeline_diffusers_samples(
    tmp_path: Path,
) -> None:
    _write_inputs(tmp_path)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", readme_block()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    export = tmp_path / "outputs/finetune_diffusion/diffusers"
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert "(a pipeline: DiffusionPipeline.from_pretrained loads it)" in run.stdout
    manifest = json.loads((tmp_path / "data/latents/manifest.json").read_text())
    assert manifest["num_samples"] == 3
    from safetensors.torch import load_file

    weights = "transformer/diffusion_pytorch_model.safetensors"
    trained, start = load_file(export / weights), load_file(tmp_path / "tiny/wan" / weights)
    assert trained.keys() == start.keys()
    assert any(not (trained[k] == start[k]).all() for k in trained)  # 20 steps moved them
    from PIL import Image

    previews = tmp_path / "outputs/finetune_diffusion/preview"
    for name in ("step_00000010.gif", "step_00000020.gif"):  # the clip: 5 decoded frames
        with Image.open(previews / name) as gif:
            assert gif.n_frames == 5
    with Image.open(tmp_path / "sample.gif") as gif:
        assert gif.n_frames == 5 and gif.size == (32, 32)

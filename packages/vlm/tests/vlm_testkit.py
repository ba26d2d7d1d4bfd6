"""Helpers the vlm tests share: synthetic video files, packed Qwen2.5-VL-style rows and tiny
random Hugging Face checkpoints of each family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch


def random_frames(n: int, h: int, w: int, seed: int) -> list[np.ndarray]:
    """``n`` random ``h x w`` RGB frames (uint8) from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def write_mp4(path: Path, frames: list[np.ndarray], fps: int) -> None:
    """Encode ``frames`` with PyAV (skips the test when no encoder is available)."""
    av = pytest.importorskip("av")
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())


def packed_image_row(cfg: Any, seed: int, grids: list[list[int]], text: int = 6) -> dict[str, Any]:
    """One packed microbatch of a Qwen2.5-VL-style ``cfg``: per grid, ``text`` random tokens,
    one image in its vision start / end tokens and ``text`` more, with next-token labels and
    a loss mask without image positions or targets across a sample boundary."""
    v = cfg.vision
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    bounds = [0]
    for grid in grids:
        n = grid[0] * grid[1] * grid[2] // v.spatial_merge_size**2
        sample = torch.randint(0, 300, (text,), generator=g).tolist()
        sample += [cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id]
        sample += torch.randint(0, 300, (text,), generator=g).tolist()
        ids += sample
        bounds.append(len(ids))
    input_ids = torch.tensor([ids])
    labels = torch.roll(input_ids, -1, dims=1)
    loss_mask = (input_ids != cfg.image_token_id).float()
    for b in bounds[1:]:
        loss_mask[0, b - 1] = 0.0  # no target across a sample boundary
    gt = torch.tensor(grids)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "cu_seqlens": bounds,
        "pixel_values": torch.randn(int(gt.prod(-1).sum()), v.patch_dim, generator=g),
        "image_grid_thw": gt,
    }


HF_CLASSES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
}
"""Each VLM family's ``transformers`` model class."""


def make_qwen2_5_vl_checkpoint(
    out: Path, *, eos_first: bool = False, max_pixels: int = 12544, seed: int = 0
) -> Path:
    """``make_vlm_checkpoint`` of Qwen2.5-VL."""
    return make_vlm_checkpoint(
        out, "qwen2_5_vl", eos_first=eos_first, max_pixels=max_pixels, seed=seed
    )


def make_vlm_checkpoint(
    out: Path,
    family: str,
    *,
    eos_first: bool = False,
    max_pixels: int = 12544,
    seed: int = 0,
) -> Path:
    """A tiny random Hugging Face directory of the VLM ``family`` (``HF_CLASSES``) as a user
    downloads one: weights, ``config.json`` (the vision token ids of its tokenizer), the
    shapes tokenizer with Qwen's chat template and, for the Qwen families, a
    ``preprocessor_config.json`` with ``max_pixels``. ``eos_first``: every embedding points
    one way and EOS's furthest, so the (tied) head predicts EOS first whatever the prompt, a
    model whose ``generate()`` must stop at once."""
    import dataclasses
    import importlib
    import json

    import transformers

    from longboat.vlm.data.shapes_dataset import build_shapes_tokenizer

    module = importlib.import_module(f"longboat.vlm.models.{family}.model")
    info = build_shapes_tokenizer(out)
    base = module.flavor("tiny")
    ids = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    cfg = dataclasses.replace(base, **{k: getattr(info, k) for k in ids if hasattr(base, k)})
    torch.manual_seed(seed)
    model = getattr(transformers, HF_CLASSES[family])(module.to_hf_config(cfg)).eval()
    with torch.no_grad():
        if not eos_first:  # weights spread wide enough that answers follow the input
            for name, p in model.named_parameters():
                p.normal_(0.0, 0.08)
                if "norm" in name or "ln_q" in name:
                    p.add_(1.0)
        # ids past the tokenizer's (the vocabulary's padding) never win
        model.get_input_embeddings().weight[info.vocab_size :] = 0.0
    if eos_first:
        with torch.no_grad():
            emb = model.get_input_embeddings().weight
            emb.normal_(0.0, 0.01)
            emb[:, 0] += 10.0
            emb[info.eos_token_id, 0] += 20.0
    model.save_pretrained(out)
    if family == "llava_onevision":
        return out
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "patch_size": cfg.vision.patch_size,
                "temporal_patch_size": cfg.vision.temporal_patch_size,
                "merge_size": cfg.vision.spatial_merge_size,
                "min_pixels": 64,
                "max_pixels": max_pixels,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
            }
        )
    )
    return out


_CLI_SEQUENCE = """\
import json, sys
from longboat.vlm.cli import main
for argv in json.loads(sys.argv[1]):
    print("\\n=== longboat-vlm", json.dumps(argv), flush=True)
    code = main(argv)
    print(f"\\n=== exit {code}", flush=True)
    if code:
        sys.exit(code)
"""


def run_cli_commands(
    commands: list[list[Any]], *, cwd: Path | None = None, timeout: float = 600
) -> list[str]:
    """Run ``longboat-vlm`` ``commands`` one after another in ONE fresh Python on the CPU (what
    ``python -m longboat.vlm.cli ARGV`` runs for each: ``main(ARGV)``), paying its imports
    once. Returns each command's stdout; raises with the output's tail when one exits
    non-zero."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "LONGBOAT_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    argvs = [list(map(str, c)) for c in commands]
    done = subprocess.run(
        [sys.executable, "-c", _CLI_SEQUENCE, json.dumps(argvs)], env=env, cwd=cwd,
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(
            f"longboat-vlm exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    sections = done.stdout.split("\n=== longboat-vlm ")[1:]
    assert len(sections) == len(argvs), done.stdout[-3000:]
    return [s.split("\n", 1)[1].rsplit("\n=== exit 0", 1)[0] for s in sections]

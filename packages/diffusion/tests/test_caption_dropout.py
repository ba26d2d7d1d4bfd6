"""Caption dropout for classifier-free guidance (``data.caption_dropout``): the empty caption's
embedding in every dataset, the dropped samples' text replaced by it, seeded draws, the
config checks and a training run that uses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import longboat.diffusion.models.wan.model  # noqa: F401  (megatron imported once, before forking)
from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess
from longboat.diffusion.data.batching import collate_latents
from longboat.diffusion.train.caption_dropout import CaptionDropout


def _batch(n: int, lengths: list[int], dim: int = 8) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    samples = [
        {
            "latents": torch.randn(16, 1, 4, 4, generator=g),
            "text_embeds": torch.randn(n_tok, dim, generator=g),
            "caption": f"caption {i}",
            "metadata": {},
            "index": i,
        }
        for i, n_tok in zip(range(n), lengths, strict=True)
    ]
    return collate_latents(samples)


def test_dropped_samples_get_the_empty_caption_and_the_rest_stay() -> None:
    empty = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    drop = CaptionDropout(0.5, empty, seed=7)
    batch = _batch(6, [2, 2, 1, 2, 2, 1])  # padded to 2 tokens; the empty caption has 3
    seen = 0
    for step in range(6):
        out = drop.apply(batch, step, position=1)
        again = drop.apply(batch, step, position=1)
        assert torch.equal(out["text_embeds"], again["text_embeds"])  # seeded by the position
        rows = drop.dropped(6, step, 1)
        seen += int(rows.sum())
        if not rows.any():
            assert out is batch
            continue
        assert out["text_embeds"].shape == (6, 3, 8) and out["text_mask"].shape == (6, 3)
        for i in range(6):
            if rows[i]:
                assert torch.equal(out["text_embeds"][i], empty)
                assert out["text_mask"][i].tolist() == [True, True, True]
            else:
                n = int(batch["text_mask"][i].sum())
                assert torch.equal(out["text_embeds"][i, :n], batch["text_embeds"][i, :n])
                assert out["text_mask"][i].tolist() == [True] * n + [False] * (3 - n)
                assert not out["text_embeds"][i, n:].any()
        assert torch.equal(out["latents"], batch["latents"])
    assert 0 < seen < 36
    share = np.mean(
        [float(drop.dropped(64, s, p).float().mean()) for s in range(20) for p in (0, 3)]
    )
    assert abs(share - 0.5) < 0.05, share
    assert not CaptionDropout(0.0, empty, seed=7).dropped(1000, 0, 0).any()


def test_prepare_writes_the_empty_caption_and_a_rerun_adds_it(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from PIL import Image

    from longboat.core.config.compose import compose_experiment
    from longboat.diffusion.data.empty_caption import EMPTY_CAPTION, read_empty_caption
    from longboat.diffusion.data.encoders import EncoderDirs, WanEncoders
    from longboat.diffusion.data.prepare import prepare_latents
    from longboat.diffusion.data.schema import PrepareConfig
    from longboat.diffusion.data.tiny_encoders import build_tiny_wan_encoders

    enc = build_tiny_wan_encoders(tmp_path / "enc", texts=["a red dot", "a blue dot"])
    (tmp_path / "in").mkdir()
    for i, caption in enumerate(["a red dot", "a blue dot"]):
        img = np.full((32, 32, 3), 40 * i, dtype=np.uint8)
        Image.fromarray(img).save(tmp_path / "in" / f"{i}.png")
        (tmp_path / "in" / f"{i}.txt").write_text(caption)
    cfg = PrepareConfig(
        input=str(tmp_path / "in"), out=str(tmp_path / "lat"), model_dir=str(enc),
        height=32, width=32, num_frames=1, dtype="float32", text_encoder_dtype="float32",
    )  # fmt: skip
    prepare_latents(cfg)
    want = WanEncoders(EncoderDirs(enc / "vae", enc / "text_encoder", enc / "tokenizer"))
    want = want.encode_text("")
    assert want.shape == (1, 32)  # the end-of-text token alone
    assert torch.equal(read_empty_caption(tmp_path / "lat"), want)
    base = [
        f"data.paths=[{tmp_path / 'lat'}]",
        "data.eval_paths=[]",
        "model.init_from=null",
        "model.flavor=tiny",
    ]
    on = [*base, "data.caption_dropout=0.1"]
    compose_experiment("finetune", on, stack="diffusion")
    (tmp_path / "lat" / EMPTY_CAPTION).unlink()  # a dataset prepared before it was written
    with pytest.raises(ConfigError) as err:
        compose_experiment("finetune", on, stack="diffusion")
    assert err.value.keys == ["data.caption_dropout"] and "data prepare" in str(err.value)
    shards = {p: p.stat().st_mtime_ns for p in (tmp_path / "lat").rglob("*.safetensors")}
    report = prepare_latents(cfg)
    assert report.up_to_date and torch.equal(read_empty_caption(tmp_path / "lat"), want)
    assert {p: p.stat().st_mtime_ns for p in shards} == shards  # nothing encoded again
    with pytest.raises(ConfigError, match=r"data\.caption_dropout"):
        compose_experiment("finetune", [*base, "data.caption_dropout=1.0"], stack="diffusion")


def _run(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.train import Trainer, typed_config
    from longboat.diffusion.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="diffusion"))
    training = build_training(cfg)
    try:
        result = Trainer(cfg, training).fit()
        return {"losses": result.losses, "describe": training.describe()}
    finally:
        training.close()


@pytest.mark.multiprocess
def test_a_run_with_caption_dropout_trains_on_the_empty_caption(tmp_path: Path) -> None:
    """The same run with ``data.caption_dropout=0.5`` takes other steps than with 0 (its
    text differs), and the same ones again when repeated."""
    from longboat.diffusion.data.empty_caption import read_empty_caption
    from longboat.diffusion.data.synthetic import empty_caption_embedding

    def overrides(name: str, p: float) -> list[str]:
        return [
            f"output_dir={tmp_path / name}",
            f"data.out_dir={tmp_path / 'data'}",
            "data.num_samples=16",
            "data.num_eval_samples=0",
            "data.shapes=[[1,4,4]]",
            "model.overrides.num_layers=1",
            "model.overrides.ffn_dim=64",
            "train.micro_batch_size=8",
            "train.steps=3",
            "train.log_every=1",
            "train.eval_every=0",
            "logging.progress=false",
            "logging.trackers=[]",
            "checkpoint.every_steps=0",
            "export.enabled=false",
            "diffusion.preview=false",
            f"data.caption_dropout={p}",
        ]

    plain = run_multiprocess(_run, 1, overrides("plain", 0.0), timeout=300)[0]
    dropped = run_multiprocess(_run, 1, overrides("dropped", 0.5), timeout=300)[0]
    again = run_multiprocess(_run, 1, overrides("again", 0.5), timeout=300)[0]
    assert dropped["losses"] == again["losses"]
    assert plain["losses"][0] == dropped["losses"][0]  # zero-initialised head: text unused
    assert plain["losses"][1:] != dropped["losses"][1:]
    assert "0.5 of the captions dropped to the empty one" in dropped["describe"][2]
    assert torch.equal(read_empty_caption(tmp_path / "data"), empty_caption_embedding(32))

"""The preview's measuring stick: ``read_square`` reads the colour and motion of the synthetic
squares back from latents; the held-out set; which captions the preview samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from longboat.diffusion.data import LatentDataset, SyntheticSquaresDataConfig, generate_squares
from longboat.diffusion.data.synthetic import eval_set_config, read_square, square_record
from longboat.diffusion.train.preview import pick_captions


@pytest.mark.parametrize("jitter", [1, -1], ids=["centred", "anywhere"])
@pytest.mark.parametrize("noise", [0.0, 0.7])
def test_read_square_reads_every_sample_back(jitter: int, noise: float) -> None:
    cfg = SyntheticSquaresDataConfig(start_jitter=jitter)
    gen = torch.Generator().manual_seed(0)
    for i in range(64):  # every colour x direction x shape
        record = square_record(i, cfg)
        x = record.latents + noise * torch.randn(record.latents.shape, generator=gen)
        got = read_square(x)
        assert (got.colour, got.direction) == (
            record.extra["colour"],
            record.extra["direction"],
        ), (i, got)
        assert got.positions[0] == tuple(record.extra["start"])


def test_read_square_finds_no_square_in_blank_or_noise() -> None:
    blank = read_square(torch.zeros(16, 5, 8, 12))
    assert (blank.colour, blank.direction) == ("none", "still")
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        assert read_square(torch.randn(16, 5, 8, 12, generator=gen)).colour == "none"


def test_read_square_tells_other_motion_apart() -> None:
    cfg = SyntheticSquaresDataConfig()
    x = square_record(
        36, cfg
    ).latents  # a moving 5-frame clip: its frames in reverse move the other way
    forward = read_square(x).direction
    backward = read_square(x.flip(1)).direction
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    assert backward == opposite[forward]
    jumbled = x[:, [0, 2, 4, 1, 3]]  # two cells per frame, then back: no one-cell move wins
    assert read_square(jumbled).direction != forward


def test_held_out_set_has_the_captions_and_other_starts(tmp_path: Path) -> None:
    cfg = SyntheticSquaresDataConfig(out_dir=str(tmp_path / "data"), num_eval_samples=16)
    held = eval_set_config(cfg)
    assert held is not None and held.out_dir == str(tmp_path / "data_eval")
    assert held.num_samples == 16 and held.seed != cfg.seed
    starts = [tuple(square_record(i, cfg).extra["start"]) for i in range(16)]
    held_starts = [tuple(square_record(i, held).extra["start"]) for i in range(16)]
    assert starts != held_starts
    assert [square_record(i, cfg).caption for i in range(16)] == [
        square_record(i, held).caption for i in range(16)
    ]
    assert eval_set_config(SyntheticSquaresDataConfig(num_eval_samples=0)) is None


def test_preview_picks_distinct_captions_longest_first(tmp_path: Path) -> None:
    cfg = SyntheticSquaresDataConfig(
        out_dir=str(tmp_path / "d"), num_samples=40, shapes=[[1, 4, 4], [3, 4, 4]]
    )
    ds = LatentDataset(generate_squares(cfg))
    picked = pick_captions(ds, 6)
    captions = [ds[i]["caption"] for i in picked]
    assert len(set(captions)) == 6
    assert all(tuple(ds.shapes[i]) == (3, 4, 4) for i in picked)  # samples 16..31
    assert pick_captions(ds, 6, limit=16) == [0, 1, 2, 3]  # the first 16: stills of 4 colours


def test_preview_sheet_is_a_gif_an_mp4_or_a_png_with_captions_under_the_clips(
    tmp_path: Path,
) -> None:
    """``write_sheet``: clips scaled up side by side, each caption written under its pair;
    videos as a GIF (every frame) or an mp4 (PyAV), images as a PNG."""
    import numpy as np
    from PIL import Image

    from longboat.diffusion.data.preview import caption_strip, write_sheet

    rng = np.random.default_rng(0)  # 27 colours: a GIF's palette holds them exactly
    video = rng.choice(np.array([0, 128, 255], dtype=np.uint8), (3, 16, 16, 3))
    still = rng.choice(np.array([0, 128, 255], dtype=np.uint8), (1, 16, 16, 3))
    cells = [([video, still], "a red square moving left"), ([still, still], "a still")]
    gif = write_sheet(cells, tmp_path / "p.gif", min_height=32, columns=2)
    assert gif.suffix == ".gif"
    frames = []
    with Image.open(gif) as im:
        for k in range(im.n_frames):
            im.seek(k)
            frames.append(np.asarray(im.convert("RGB")))
    assert len(frames) == 3
    # 16 px clips scaled x2; a pair is 32 + 2 + 32 = 66 wide, a cell at least 120
    for k in range(3):
        assert np.array_equal(frames[k][:32, :32], video[k].repeat(2, 0).repeat(2, 1))
        assert np.array_equal(frames[k][:32, 34:66], still[0].repeat(2, 0).repeat(2, 1))
    strip = caption_strip("a red square moving left", 120, 1)
    assert np.array_equal(frames[0][32 : 32 + strip.shape[0], :120], strip)
    assert (strip < 128).any()
    png = write_sheet([([still], "one image")], tmp_path / "q.gif", min_height=32)
    assert png.suffix == ".png" and Image.open(png).size[1] == 32 + strip.shape[0] + 2  # + gap
    av = pytest.importorskip("av")
    mp4 = write_sheet(cells, tmp_path / "p", min_height=32, columns=2, video="mp4")
    assert mp4.suffix == ".mp4"
    with av.open(str(mp4)) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(decoded) == 3
    luma = np.array([0.299, 0.587, 0.114])  # 4:2:0 H.264 keeps brightness at full resolution
    for k in range(3):
        err = np.abs((decoded[k][:32, :66] - frames[k][:32, :66].astype(float)) @ luma).mean()
        other = np.abs((decoded[k][:32, :32] - frames[(k + 1) % 3][:32, :32].astype(float)) @ luma)
        assert err < 10 < other.mean(), (err, other.mean())


def test_an_unknown_preview_format_is_named() -> None:
    from longboat.core.config.compose import compose_experiment
    from longboat.core.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        compose_experiment("quickstart", ["diffusion.preview_format=webm"], stack="diffusion")
    assert err.value.keys == ["diffusion.preview_format"]


def test_the_squares_vae_draws_the_latents_and_encodes_them_back(tmp_path: Path) -> None:
    """``squares_vae``: ``decode`` paints each latent cell as an 8x8 block of its colour and
    each latent frame after the first as 4 frames; ``encode`` of that video is the latents.
    ``generate_squares`` writes it beside the set, where the preview's decoder finds it."""
    pytest.importorskip("diffusers")
    import math

    import numpy as np

    from longboat.diffusion.data.preview import colour_basis
    from longboat.diffusion.data.synthetic import BACKGROUND, COLOURS
    from longboat.diffusion.data.vae_decode import LatentDecoder

    cfg = SyntheticSquaresDataConfig(
        out_dir=str(tmp_path / "d"), num_samples=20, shapes=[[3, 4, 6]], num_eval_samples=0
    )
    ds = LatentDataset(generate_squares(cfg))
    decoder = LatentDecoder.of_dataset(ds)
    assert decoder is not None and decoder.dir == tmp_path / "d" / "vae"
    record = square_record(17, cfg)  # green, moving left
    z = record.latents
    with torch.no_grad():
        video = decoder.vae.decode(z[None]).sample[0]  # [3, 9, 32, 48]
    assert tuple(video.shape) == (3, 1 + 4 * 2, 32, 48) == (3, record.frames, 32, 48)
    # what the latents say: the colour of each cell, 8x8 pixels, latent frame f -> 4 frames
    c = torch.einsum("ck,cthw->kthw", torch.tensor(colour_basis(16), dtype=torch.float32), z)
    c = c.repeat_interleave(8, 2).repeat_interleave(8, 3) / math.sqrt(16 / 3)
    want = c[:, [0, 1, 1, 1, 1, 2, 2, 2, 2]]
    assert (video - want).abs().max() < 1e-4
    assert set(np.unique(want.numpy().round(4))) == {-1.0, -0.75, 1.0}  # background, green
    pixels = decoder.decode(z)
    green = np.all(pixels == 255 * np.asarray(COLOURS["green"]), axis=-1)
    dark = np.all(pixels == round(255 * BACKGROUND[0]), axis=-1)
    assert (green | dark).all() and green.sum() == 9 * 16 * 16  # 2x2 cells in each frame
    with torch.no_grad():
        back = decoder.vae.encode(video[None]).latent_dist
    assert (back.mean[0] - z).abs().max() < 1e-4 and back.std.max() < 1e-6
    assert read_square(back.mean[0]).direction == "left"
    batch = decoder.decode(torch.stack([z, z.flip(1)]))  # one call, two clips
    assert batch.shape == (2, 9, 32, 48, 3) and np.array_equal(batch[0], pixels)

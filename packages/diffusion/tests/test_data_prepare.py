"""``data prepare`` with tiny random Wan encoders: equal to encoding directly, bad inputs,
resuming a killed run, the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from longboat.core.config.errors import ConfigError
from longboat.diffusion.cli import main
from longboat.diffusion.data import BadSampleError, DataError, LatentDataset, PrepareConfig
from longboat.diffusion.data.encoders import EncoderDirs, WanEncoders
from longboat.diffusion.data.media import frame_indices
from longboat.diffusion.data.prepare import prepare_latents
from longboat.diffusion.data.shards import MANIFEST, file_sha256, read_manifest

av = pytest.importorskip("av")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

CAPTIONS = {
    "clips/a.mp4": "a red square moving left",
    "clips/b.mp4": "a blue ball bouncing up and down",
    "stills/c.png": "a cat sitting on a chair",
    "stills/d.png": "waves on the sea",
}


def _pattern(t: int, h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h, w, 3))
    yy, xx = np.mgrid[0:h, 0:w]
    ramp = (3 * yy + 2 * xx)[..., None]
    frames = [(base + 9 * k + ramp) % 256 for k in range(t)]
    return np.stack(frames).astype(np.uint8)


def _write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.height, s.width = frames.shape[1:3]
        s.pix_fmt = "yuv420p"
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)


@pytest.fixture(scope="module")
def encoders_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from longboat.diffusion.data.tiny_encoders import build_tiny_wan_encoders

    return build_tiny_wan_encoders(tmp_path_factory.mktemp("wan"), texts=CAPTIONS.values())


@pytest.fixture(scope="module")
def encoders(encoders_dir: Path) -> WanEncoders:
    d = encoders_dir
    return WanEncoders(EncoderDirs(d / "vae", d / "text_encoder", d / "tokenizer"))


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    root = tmp_path / "in"
    _write_mp4(root / "clips/a.mp4", _pattern(11, 40, 56, 1), fps=8)  # landscape, 11 frames
    _write_mp4(root / "clips/b.mp4", _pattern(7, 48, 34, 2), fps=10)  # portrait, 7 frames
    from PIL import Image

    (root / "stills").mkdir()
    Image.fromarray(_pattern(1, 30, 50, 3)[0]).save(root / "stills/c.png")
    Image.fromarray(_pattern(1, 64, 40, 4)[0]).save(root / "stills/d.png")
    for name, cap in CAPTIONS.items():
        (root / name).with_suffix(".txt").write_text(cap + "\n")
    return root


def _cfg(inputs: Path, out: Path, encoders_dir: Path, **kw) -> PrepareConfig:
    opts = {
        "input": str(inputs),
        "out": str(out),
        "model_dir": str(encoders_dir),
        "sizes": [[32, 48], [48, 32]],
        "num_frames": 9,
        "fps": None,
        "dtype": "float32",
        "text_encoder_dtype": "float32",
        "samples_per_shard": 2,
        "device": "cpu",
    }
    return PrepareConfig(**{**opts, **kw})


def _reference(path: Path, idx: list[int] | None, size: tuple[int, int]) -> np.ndarray:
    """Frames decoded, picked, scaled to cover ``size`` and centre-cropped, written out here."""
    from PIL import Image

    if path.suffix == ".png":
        raw = [np.asarray(Image.open(path).convert("RGB"))]
        idx = [0]
    else:
        with av.open(str(path)) as c:
            raw = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    h, w = size
    out = []
    for i in idx:
        img = Image.fromarray(raw[i])
        s = max(h / img.height, w / img.width)
        nw, nh = max(w, round(img.width * s)), max(h, round(img.height * s))
        img = img.resize((nw, nh), Image.Resampling.BICUBIC)
        left, top = (nw - w) // 2, (nh - h) // 2
        out.append(np.asarray(img.crop((left, top, left + w, top + h))))
    return np.stack(out)


def test_prepare_equals_encoding_directly(inputs: Path, tmp_path: Path, encoders_dir: Path) -> None:
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    cfg = _cfg(inputs, tmp_path / "out", encoders_dir)
    report = prepare_latents(cfg)
    assert (report.encoded, report.num_samples, report.num_shards) == (4, 4, 2)
    ds = LatentDataset(cfg.out, verify=True)
    vae = AutoencoderKLWan.from_pretrained(encoders_dir / "vae").eval()
    te = UMT5EncoderModel.from_pretrained(encoders_dir / "text_encoder").eval()
    tok = AutoTokenizer.from_pretrained(encoders_dir / "tokenizer")
    mean = torch.tensor(vae.config.latents_mean).reshape(-1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).reshape(-1, 1, 1, 1)
    # a.mp4: 11 frames -> 9 kept, landscape -> 32x48; b.mp4: 7 -> 5, portrait -> 48x32.
    expect = {
        "clips/a.mp4": (list(range(9)), (32, 48), 8.0),
        "clips/b.mp4": (list(range(5)), (48, 32), 10.0),
        "stills/c.png": (None, (32, 48), 0.0),
        "stills/d.png": (None, (48, 32), 0.0),
    }
    assert [ds[i]["metadata"]["source"] for i in range(4)] == list(CAPTIONS)
    for i, (name, (idx, size, fps)) in enumerate(expect.items()):
        frames = _reference(inputs / name, idx, size)
        x = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
        with torch.no_grad():
            z = (vae.encode(x).latent_dist.mean[0] - mean) / std
            ids = tok(CAPTIONS[name], return_tensors="pt").input_ids
            assert ids[0, -1].item() == tok.eos_token_id
            text = te(input_ids=ids).last_hidden_state[0]
        s = ds[i]
        t_lat = 1 + (len(frames) - 1) // 4
        assert s["latents"].shape == (16, t_lat, size[0] // 8, size[1] // 8)
        assert (s["latents"] - z).abs().max().item() < 1e-5
        assert s["text_embeds"].shape == (ids.shape[1], 32)
        assert (s["text_embeds"] - text).abs().max().item() < 1e-5
        assert s["caption"] == CAPTIONS[name]
        assert s["metadata"] == {
            "source": name,
            "fps": fps,
            "frames": len(frames),
            "height": size[0],
            "width": size[1],
        }
    m = read_manifest(cfg.out)
    assert m["complete"] and m["sources"] == {"total": 4, "done": 4, "skipped": []}
    assert m["encoders"]["vae"]["class"] == "AutoencoderKLWan"
    assert m["encoders"]["vae"]["dir"] == str(encoders_dir / "vae")
    assert "config.json" in m["encoders"]["text_encoder"]["configs"]


def test_frame_sampling_at_a_target_fps() -> None:
    # 8 fps source, 4 fps target: every second frame; 11 frames hold 6 -> 5 (4k + 1) kept.
    assert frame_indices(11, 8.0, 9, 4.0) == [0, 2, 4, 6, 8]
    assert frame_indices(100, 30.0, 5, 16.0) == [round(k * 30 / 16 + 1e-9) for k in range(5)]
    assert frame_indices(100, 24.0, 9, None) == list(range(9))
    assert frame_indices(3, 24.0, 9, None) == [0]
    assert frame_indices(0, 24.0, 9, None) == []
    assert math.floor(1 * 30 / 16 + 0.5) == 2


def test_bad_inputs_name_the_file_or_are_skipped(
    inputs: Path, tmp_path: Path, encoders_dir: Path, encoders: WanEncoders
) -> None:
    (inputs / "clips/b.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    (inputs / "stills/d.txt").unlink()
    with pytest.raises(BadSampleError, match=r"clips/b\.mp4: not a readable video"):
        prepare_latents(_cfg(inputs, tmp_path / "o1", encoders_dir), encoders=encoders)
    report = prepare_latents(
        _cfg(inputs, tmp_path / "o2", encoders_dir, skip_bad_samples=True), encoders=encoders
    )
    assert (report.num_samples, len(report.skipped)) == (2, 2)
    files = sorted(Path(s["file"]).name for s in report.skipped)
    assert files == ["b.mp4", "d.png"]
    assert "no caption (expected in" in report.skipped[1]["problem"]
    assert "d.txt" in report.skipped[1]["problem"]
    assert [LatentDataset(tmp_path / "o2")[i]["caption"] for i in range(2)] == [
        CAPTIONS["clips/a.mp4"],
        CAPTIONS["stills/c.png"],
    ]
    # A list file: a missing caption names the file too.
    lst = tmp_path / "list.jsonl"
    lst.write_text(
        json.dumps({"path": "in/clips/a.mp4", "caption": "x"})
        + "\n"
        + json.dumps({"path": "in/stills/c.png"})
        + "\n"
    )
    with pytest.raises(
        BadSampleError, match=r"stills/c\.png: no caption \(expected in .*list\.jsonl line 2\)"
    ):
        prepare_latents(_cfg(lst, tmp_path / "o3", encoders_dir), encoders=encoders)
    lst.write_text("{not json\n")
    with pytest.raises(DataError, match=r"list\.jsonl line 1: not JSON"):
        prepare_latents(_cfg(lst, tmp_path / "o4", encoders_dir), encoders=encoders)


class _Counting:
    """Real encoders that count frame encodings and can stop the run at the n-th one."""

    def __init__(self, inner: WanEncoders, stop_at: int | None = None) -> None:
        self.inner, self.stop_at, self.calls = inner, stop_at, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode_frames(self, frames):
        self.calls += 1
        if self.stop_at is not None and self.calls == self.stop_at:
            raise KeyboardInterrupt  # the run is killed here
        return self.inner.encode_frames(frames)


def test_killed_prepare_resumes_without_reencoding_finished_shards(
    inputs: Path, tmp_path: Path, encoders_dir: Path, encoders: WanEncoders
) -> None:
    ref = tmp_path / "ref"
    prepare_latents(_cfg(inputs, ref, encoders_dir, samples_per_shard=1), encoders=encoders)
    out = tmp_path / "out"
    cfg = _cfg(inputs, out, encoders_dir, samples_per_shard=1)
    with pytest.raises(KeyboardInterrupt):
        prepare_latents(cfg, encoders=_Counting(encoders, stop_at=3))
    m = read_manifest(out)
    assert not m["complete"] and m["sources"]["done"] == 2 and m["num_shards"] == 2
    finished = {p.name: (file_sha256(p), p.stat().st_mtime_ns) for p in (out / "shards").iterdir()}
    assert sorted(finished) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    with pytest.raises(DataError, match="has not finished"):
        LatentDataset(out)
    # What a kill can leave behind: a temporary file, a shard the manifest never listed.
    (out / "shards" / ".shard-00002.safetensors.tmp-999999999").write_bytes(b"partial")
    (out / "shards" / "shard-00002.safetensors").write_bytes(b"never listed")
    again = _Counting(encoders)
    report = prepare_latents(cfg, encoders=again)
    assert again.calls == 2 and report.encoded == 2 and report.resumed_from == 2
    for name, (digest, mtime) in finished.items():
        p = out / "shards" / name
        assert (file_sha256(p), p.stat().st_mtime_ns) == (digest, mtime)
    assert not list((out / "shards").glob(".*tmp*"))
    a, b = LatentDataset(out, verify=True), LatentDataset(ref)
    assert len(a) == len(b) == 4
    for i in range(4):
        assert torch.equal(a[i]["latents"], b[i]["latents"])
        assert torch.equal(a[i]["text_embeds"], b[i]["text_embeds"])
    # Finished: a re-run does nothing; other options are refused unless overwrite=true.
    idle = _Counting(encoders)
    assert prepare_latents(cfg, encoders=idle).up_to_date and idle.calls == 0
    other = _cfg(inputs, out, encoders_dir, samples_per_shard=1, num_frames=5)
    with pytest.raises(DataError, match=r"holds a preparation with other options"):
        prepare_latents(other, encoders=encoders)
    redo = prepare_latents(
        _cfg(inputs, out, encoders_dir, samples_per_shard=4, num_frames=5, overwrite=True),
        encoders=encoders,
    )
    assert redo.encoded == 4 and redo.num_shards == 1
    assert LatentDataset(out).shapes[:2, 0].tolist() == [2, 2]  # 5 frames -> 2 latent frames


def test_config_and_command_line(inputs: Path, tmp_path: Path, encoders_dir: Path, capsys) -> None:
    with pytest.raises(ConfigError) as err:
        PrepareConfig(input="x", out="y", num_frames=8, height=40, dtype="int8").validate()
    assert set(err.value.keys) == {"vae", "text_encoder", "num_frames", "height/width", "dtype"}
    out = tmp_path / "cli"
    args = [
        "data",
        "prepare",
        f"input={inputs}",
        f"out={out}",
        f"model_dir={encoders_dir}",
        "sizes=[[32,32]]",
        "num_frames=5",
        "fps=null",
        "device=cpu",
        "text_encoder_dtype=float32",
        "--no-progress",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "encoded 4 of 4 inputs" in printed and "4 samples in 1 shards" in printed
    assert main(["data", "inspect", str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "4 samples in 1 shards" in printed and "16 channels" in printed
    assert "[2, 4, 4]: 2" in printed and "[1, 4, 4]: 2" in printed
    assert repr(CAPTIONS["clips/a.mp4"]) in printed and "verified" in printed
    # Bad input: exit 2, one message naming the key or file, no traceback.
    (inputs / "clips/a.txt").unlink()
    bad = [
        ([*args[:3], f"out={tmp_path / 'c2'}", *args[4:]], r"clips/a\.mp4: no caption"),
        (["data", "prepare", f"input={inputs}", "outt=x"], r"outt=.x.: unknown key"),
        (
            [
                "data",
                "prepare",
                f"input={inputs}",
                f"out={tmp_path}",
                "vae=/nope",
                "text_encoder=/nope",
            ],
            r"vae='/nope': no such directory",
        ),
        (["data", "inspect", str(tmp_path / "missing")], r"does not exist"),
    ]
    for argv, message in bad:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert __import__("re").search(message, err), err
    assert (out / MANIFEST).is_file()
